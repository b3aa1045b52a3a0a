//! Waiting (ADR-14, ADR-15).
//!
//! Waiters for one key on this arbiter form a FIFO: only the head runs grant
//! transactions, so a release wakes one attempt, not a herd. Envoy ring-hashes the
//! ext_proc stream on the lock key, so all waiters of a key normally meet here.
//!
//! The head waits for any of: a watch event on the key's holders from the revision
//! of its failed transaction (no event between the check and the watch is lost), a
//! release through this arbiter, or a jittered ~1 s poll that covers a lost
//! notification or a watch cancelled by compaction. None of them grants anything:
//! each only triggers another grant transaction.
//!
//! # Hand-off
//!
//! A gated head also posts an *offer* on its queue: its request and session. A
//! release of the key through this arbiter takes the offer and tries to release and
//! grant in one transaction (`mutex`), so a hot key costs one etcd write per
//! hand-over instead of two. The offer is taken by exactly one side: the releaser
//! (which then always answers the waiter: granted, or retry) or the waiter leaving
//! its wait (withdrawn), so a waiter never runs its own grant while a hand-off for
//! it may commit. A head that reads a key granted here before it waits posts its
//! offer before that read ([`Store::post_offer`], `mutex`), so a release during the
//! read still hands over; a read that says not to wait settles the offer
//! ([`Store::settle_offer`]) before anything else.
//!
//! A release that finds no offer on a key whose last release here handed it over
//! (a chain) waits up to `handoff_grace_ms` for the next head's offer
//! ([`Queues::offer_within_grace`]): on a hot key that head is on its way, passed on
//! by the filter when the new holder was answered.
//!
//! # The waiters' book
//!
//! What the wait metrics and the console show (docs/OPERATIONS.md) is kept per store
//! in a [`WaitBook`], only for keys with a *gated* waiter here: one that had to
//! wait (behind another waiter, or refused `key_gated` as the head, or queued in
//! etcd for a durable class), from when it began waiting until it leaves. Per key:
//! when each gated waiter began waiting (the oldest gated waiter's age), how many
//! times its waiters woke to look again since the key's last grant here (a release
//! hint or a queue move waking every waiter of the key, a watch event, a poll, a
//! hand-off answer: the wake-ups per grant), and when the last release of the key
//! through here began (the pickup latency: from the start of that release's
//! transaction to the commit of the key's next grant here; one transaction for a
//! hand-off). A key's labels come from the first of its waiters that waits with
//! its request in hand (a gated head, a durable waiter); waiters behind a head
//! that never waited are not shown until then. With no gated waiter anywhere here
//! the release and grant paths only read one atomic.

use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, LazyLock, Mutex, Weak,
    },
    time::Duration,
};

use etcd_client::WatchOptions;
use lockmesh_core::{headers::SessionId, KeyDigest, Reason};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge, histogram::Histogram, MetricType},
    registry::Registry,
};
use rand::Rng;
use tokio::{
    sync::{oneshot, Notify},
    time::Instant,
};
use tokio_util::sync::CancellationToken;

use super::{
    mutex::{AcquireRequest, Grant},
    quota::{LockLabelSet, Quotas},
    test_faults, Keys, LockError, SessionRecord, Store,
};

/// Base poll period while gated.
pub const POLL: Duration = Duration::from_millis(1000);

/// How long a head with a posted offer waits before it watches its key's holders
/// (`Store::wait_offered`): a hot key's hand-over through here takes about 2 ms,
/// so its heads never create a watcher; a release elsewhere or an expiry is seen
/// this much later (issue 20: etcd CPU per hot cycle −12 %, the arbiter's −8 %).
pub const WATCH_AFTER_OFFER: Duration = Duration::from_millis(5);

/// Whether releases hand keys over (config `handoff`; on by default, off only to
/// measure what it saves), and how long a release of a key in a hand-off chain
/// waits for the next head's offer when none is posted yet (config
/// `handoff_grace_ms`, default 2 ms; zero: never waits; see [`Queues::chained`]).
/// One arbiter's ([`crate::runtime::Runtime::handoff`]): every cluster's store
/// follows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handoff {
    /// Releases hand keys over to a posted offer.
    pub on: bool,
    /// The grace a release in a chain waits for an offer.
    pub grace: Duration,
}

impl Default for Handoff {
    fn default() -> Self {
        Self { on: true, grace: Duration::from_millis(2) }
    }
}

/// Hand-off attempts by result (process-wide counters, exposed by [`HandoffCounts::register`]).
pub static HANDOFFS: HandoffCounts = HandoffCounts {
    granted: AtomicU64::new(0),
    released_only: AtomicU64::new(0),
    not_done: AtomicU64::new(0),
    failed: AtomicU64::new(0),
    offers: AtomicU64::new(0),
    grace_offered: AtomicU64::new(0),
    grace_expired: AtomicU64::new(0),
};

/// Counts of release hand-off attempts.
pub struct HandoffCounts {
    /// Released and granted in one transaction.
    pub granted: AtomicU64,
    /// Released, the grant taken back (sealed).
    pub released_only: AtomicU64,
    /// Not written (waiter's session gone, draining, compare failed): plain release.
    pub not_done: AtomicU64,
    /// etcd failed: outcome unknown, the release answered `unavailable`.
    pub failed: AtomicU64,
    /// Offers posted now (gated heads waiting for a release here).
    pub offers: AtomicU64,
    /// Releases in a chain that found no offer and waited: one came in the grace.
    pub grace_offered: AtomicU64,
    /// ... none came: the release ran plainly and ended the chain.
    pub grace_expired: AtomicU64,
}

// === impl HandoffCounts ===

impl HandoffCounts {
    /// Adds `lockmesh_arbiter_handoffs_total{outcome}` (every outcome, from 0) and
    /// `lockmesh_arbiter_handoff_offers` to `registry`, read from [`HANDOFFS`] at
    /// each scrape: the counters stay plain atomics the release path bumps.
    pub fn register(registry: &mut Registry) {
        registry.register_collector(Box::new(HandoffCollector));
    }
}

/// Encodes [`HANDOFFS`] at scrape time.
#[derive(Debug)]
struct HandoffCollector;

impl Collector for HandoffCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let c = &HANDOFFS;
        // A collector's help is written as given (the registry's own metrics get a `.` appended).
        let mut family = encoder.encode_descriptor(
            "lockmesh_arbiter_handoffs",
            "Releases that tried to hand the key to a waiter in the same transaction, by outcome.",
            None,
            MetricType::Counter,
        )?;
        for (outcome, n) in [
            ("granted", &c.granted),
            ("released_only", &c.released_only),
            ("not_done", &c.not_done),
            ("failed", &c.failed),
        ] {
            ConstCounter::new(n.load(Ordering::Relaxed)).encode(family.encode_family(&[("outcome", outcome)])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "lockmesh_arbiter_handoff_grace_waits",
            "Releases of a key whose last release here handed it over that found no offer posted and waited up to handoff_grace_ms for one: offered (one came; handed over in one transaction) or expired (none; a plain release, the chain ends).",
            None,
            MetricType::Counter,
        )?;
        for (outcome, n) in [("offered", &c.grace_offered), ("expired", &c.grace_expired)] {
            ConstCounter::new(n.load(Ordering::Relaxed)).encode(family.encode_family(&[("outcome", outcome)])?)?;
        }
        let offers = ConstGauge::new(i64::try_from(c.offers.load(Ordering::Relaxed)).unwrap_or(i64::MAX));
        offers.encode(encoder.encode_descriptor(
            "lockmesh_arbiter_handoff_offers",
            "Gated head waiters on this arbiter ready to take a key in its release transaction.",
            None,
            MetricType::Gauge,
        )?)
    }
}

/// How many hand-off hold names (`<slot>.1`) are remembered for the release fast
/// path; past it the memory is dropped and releases take the read-first path.
const HANDED_NAMES_MAX: usize = 65_536;

#[derive(Default)]
struct KeyQueue {
    order: VecDeque<u64>,
    /// Woken when the head changes or a release of the key passed through here.
    notify: Arc<Notify>,
    /// The gated head's offer, when it waits for a release (see the module docs).
    offer: Option<Offer>,
}

/// A gated head waiter's request, for a releaser to grant in its own transaction.
pub(crate) struct Offer {
    ticket: u64,
    /// The waiter's acquire.
    pub req: AcquireRequest,
    /// The session its grant goes on.
    pub sid: SessionId,
    /// The record of that session when the acquire opened it and no transaction
    /// wrote it yet (the header-only path): the hand-off puts it.
    pub record: Option<SessionRecord>,
    /// Where the releaser answers.
    pub tx: oneshot::Sender<Handed>,
}

/// A releaser's answer to an offer.
pub(crate) enum Handed {
    /// Granted in the release transaction.
    Granted(Grant),
    /// Not granted: the waiter runs its own grant transaction.
    Retry,
}

/// A grant of a mutex key made here, as the next acquire of the key here sees
/// it ([`Queues::held_by`]): its commit revision, its session and a digest of its
/// caller (identity and instance). No strings are kept: a digest that collides
/// only makes an acquire read what it could have skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldBy {
    /// The grant's commit revision (its token's).
    pub revision: i64,
    lease: i64,
    caller: u64,
}

impl HeldBy {
    /// The grant `g` of `req`, committed at `revision`.
    pub fn of(req: &AcquireRequest, g: &Grant, revision: i64) -> Self {
        Self { revision, lease: g.session.lease(), caller: caller_digest(req) }
    }

    /// Whether a read of the holders could answer `req` on session `sid` without
    /// a wait: an acquire on the holder's own session (an idempotent re-acquire,
    /// or its own second hold) or by the holder's caller and declared instance
    /// (a leak, `Leaked`). Every other acquire can only wait for this hold.
    pub fn may_answer(&self, req: &AcquireRequest, sid: SessionId) -> bool {
        self.lease == sid.lease() || (req.caller.instance.is_some() && self.caller == caller_digest(req))
    }
}

/// A digest of `req`'s caller identity and declared instance.
fn caller_digest(req: &AcquireRequest) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    (&req.caller.identity, &req.caller.instance).hash(&mut h);
    h.finish()
}

/// Per-key FIFO queues of waiters on this arbiter.
pub struct Queues {
    next: AtomicU64,
    map: Mutex<HashMap<KeyDigest, KeyQueue>>,
    /// Holds this arbiter granted by hand-off under a slot's other name, by
    /// (digest, token revision): the release fast path tries that name first.
    handed_names: Mutex<HashSet<(KeyDigest, i64)>>,
    /// Mutex keys granted here with no release through here since, and by whom.
    held: Mutex<HashMap<KeyDigest, HeldBy>>,
    /// Keys whose last release here handed the key over (a chain of waiters).
    chained: Mutex<HashSet<KeyDigest>>,
    /// Woken whenever a head posts an offer (releasers in their grace wait).
    offer_posted: Notify,
    /// This arbiter's lease for durable waiter keys (`lock::durable`).
    pub(crate) durable: super::durable::WaiterLease,
    /// Gated waiters, wake-ups and releases of keys with a gated waiter here.
    book: Arc<WaitBook>,
    /// Whether and how releases hand keys over.
    handoff: Handoff,
}

impl Default for Queues {
    /// Queues with the default hand-off, whose waiters' labels name nothing (all
    /// `other`): benchmarks and tests.
    fn default() -> Self {
        Self::new(Handoff::default(), Arc::default())
    }
}

impl Queues {
    /// The queues of one store: releases hand over as `handoff` says, gated
    /// waiters are labelled by `quotas`' lock labels.
    pub fn new(handoff: Handoff, quotas: Arc<Quotas>) -> Self {
        let book = Arc::new(WaitBook::new(quotas));
        lock(&BOOKS).push(Arc::downgrade(&book));
        Self {
            handoff,
            next: AtomicU64::new(0),
            map: Mutex::default(),
            handed_names: Mutex::default(),
            held: Mutex::default(),
            chained: Mutex::default(),
            offer_posted: Notify::new(),
            durable: super::durable::WaiterLease::default(),
            book,
        }
    }
}

/// A place in a key's queue; leaving (drop) hands the head to the next waiter.
pub struct Ticket<'a> {
    queues: &'a Queues,
    digest: KeyDigest,
    id: u64,
    notify: Arc<Notify>,
}

// === impl Queues ===

impl Queues {
    /// Joins the queue of `d`.
    pub fn enter(&self, d: &KeyDigest) -> Ticket<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let q = map.entry(d.clone()).or_default();
        q.order.push_back(id);
        Ticket { queues: self, digest: d.clone(), id, notify: q.notify.clone() }
    }

    /// Wakes the head of `d`'s queue (a release of `d` went through here).
    pub fn hint(&self, d: &KeyDigest) {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).remove(d);
        self.book.released(d);
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = map.get(d) {
            q.notify.notify_waiters();
        }
    }

    /// Notes a grant of mutex key `d` made here (`by`), for the waiters queued
    /// behind it.
    /// Only a hint for the next acquire of `d` here: it waits for the holder's
    /// release instead of running a grant that can only be refused (reading the
    /// holders first unless `by` tells it the read could not answer it,
    /// `mutex`). Cleared by a release through here; bounded like the hand-off
    /// names.
    pub fn note_held(&self, d: &KeyDigest, by: HeldBy) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.len() >= HANDED_NAMES_MAX {
            held.clear();
        }
        held.insert(d.clone(), by);
    }

    /// Forgets the grant of `d` noted here if it is older than `revision`, at
    /// which a hold of `d` was deleted (the quota ledger's watch of every hold,
    /// `lock::quota`): that hold ended by an expiry, a revoke or a release
    /// elsewhere, so the next head reads or grants instead of waiting for it.
    pub(crate) fn forget_held_before(&self, d: &KeyDigest, revision: i64) {
        if test_faults::on(test_faults::TestFault::KeepEndedHeld) {
            return; // PLANTED BUG (held_memo scenario)
        }
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.get(d).is_some_and(|h| h.revision < revision) {
            held.remove(d);
        }
    }

    /// The last grant of mutex key `d` here, when no release of it passed through
    /// here since (see [`Queues::note_held`]).
    pub fn held_by(&self, d: &KeyDigest) -> Option<HeldBy> {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).get(d).copied()
    }

    /// Posts the head's offer; false (and nothing posted) when hand-off is off or
    /// `ticket` is not the head.
    pub(crate) fn post_offer(
        &self,
        d: &KeyDigest,
        ticket: u64,
        req: &AcquireRequest,
        sid: SessionId,
        record: Option<&SessionRecord>,
        tx: oneshot::Sender<Handed>,
    ) -> bool {
        if !self.handoff.on {
            return false;
        }
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        match map.get_mut(d) {
            Some(q) if q.order.front() == Some(&ticket) => {
                if q.offer.replace(Offer { ticket, req: req.clone(), sid, record: record.cloned(), tx }).is_none() {
                    HANDOFFS.offers.fetch_add(1, Ordering::Relaxed);
                }
                drop(map);
                self.offer_posted.notify_waiters();
                true
            }
            _ => false,
        }
    }

    /// Takes the offer of `d`'s head, if one is posted (a releaser: every release
    /// transaction asks first, so this is where a release of `d` begins).
    pub(crate) fn take_offer(&self, d: &KeyDigest) -> Option<Offer> {
        self.book.release_begins(d);
        self.try_take_offer(d)
    }

    fn try_take_offer(&self, d: &KeyDigest) -> Option<Offer> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let o = map.get_mut(d).and_then(|q| q.offer.take());
        if o.is_some() {
            HANDOFFS.offers.fetch_sub(1, Ordering::Relaxed);
        }
        o
    }

    /// The offer of `d`'s head for a release that found none posted
    /// ([`Queues::take_offer`]): when the key's last release here handed it over
    /// (a chain: a hot key's next head is usually on its way, passed on by the
    /// filter the moment the new holder was answered, and can arrive just after
    /// that holder's release), the release waits up to [`Handoff::grace`] for an
    /// offer; otherwise `None` at once. A release that hands over starts or
    /// continues the chain ([`Queues::chain`]); one that found no offer within
    /// the grace ends it, so only the last release of a burst waits.
    pub(crate) async fn offer_within_grace(&self, d: &KeyDigest) -> Option<Offer> {
        let Handoff { on, grace } = self.handoff;
        if grace.is_zero() || !on || !self.chained(d) {
            return None;
        }
        let until = Instant::now() + grace;
        loop {
            let posted = self.offer_posted.notified();
            tokio::pin!(posted);
            posted.as_mut().enable();
            if let Some(o) = self.try_take_offer(d) {
                HANDOFFS.grace_offered.fetch_add(1, Ordering::Relaxed);
                return Some(o);
            }
            if tokio::time::timeout_at(until, posted).await.is_err() {
                HANDOFFS.grace_expired.fetch_add(1, Ordering::Relaxed);
                self.chain(d, false);
                return None;
            }
        }
    }

    /// Whether `d`'s last release here handed it over.
    fn chained(&self, d: &KeyDigest) -> bool {
        self.chained.lock().unwrap_or_else(|p| p.into_inner()).contains(d)
    }

    /// Notes whether a release of `d` here handed it over (bounded like the
    /// hand-off names).
    pub(crate) fn chain(&self, d: &KeyDigest, handed: bool) {
        let mut chained = self.chained.lock().unwrap_or_else(|p| p.into_inner());
        if !handed {
            chained.remove(d);
            return;
        }
        if chained.len() >= HANDED_NAMES_MAX {
            chained.clear();
        }
        chained.insert(d.clone());
    }

    /// Withdraws `ticket`'s offer; false when a releaser took it first.
    fn withdraw_offer(&self, d: &KeyDigest, ticket: u64) -> bool {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        match map.get_mut(d) {
            Some(q) if q.offer.as_ref().is_some_and(|o| o.ticket == ticket) => {
                q.offer = None;
                HANDOFFS.offers.fetch_sub(1, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }

    /// Remembers a hold granted by hand-off under a slot's other name.
    pub(crate) fn remember_handed_name(&self, d: &KeyDigest, revision: i64) {
        let mut names = self.handed_names.lock().unwrap_or_else(|p| p.into_inner());
        if names.len() >= HANDED_NAMES_MAX {
            names.clear();
        }
        names.insert((d.clone(), revision));
    }

    /// Whether the hold of grant `revision` was created under a slot's other name
    /// here (forgets it: a release asks once).
    pub(crate) fn take_handed_name(&self, d: &KeyDigest, revision: i64) -> bool {
        let mut names = self.handed_names.lock().unwrap_or_else(|p| p.into_inner());
        names.remove(&(d.clone(), revision))
    }

    /// Waiters queued for `d` here.
    pub fn len(&self, d: &KeyDigest) -> usize {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(d).map_or(0, |q| q.order.len())
    }

    /// Keys with waiters here.
    pub fn keys_waiting(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn is_head(&self, d: &KeyDigest, id: u64) -> bool {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(d).and_then(|q| q.order.front()) == Some(&id)
    }

    /// A fresh waiter id (a durable waiter's place in the book).
    pub(crate) fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Waiter `id` of `d` began waiting (again: a no-op); `req` labels the key
    /// when it has no labels yet.
    pub(crate) fn gate(&self, d: &KeyDigest, id: u64, req: Option<&AcquireRequest>) {
        self.book.gate(d, id, req);
    }

    /// Waiter `id` of `d` stopped waiting (granted, or gone).
    pub(crate) fn ungate(&self, d: &KeyDigest, id: u64) {
        self.book.ungate(d, id);
    }

    /// A waiter of `d` woke to look again.
    pub(crate) fn woke(&self, d: &KeyDigest) {
        self.book.woke(d);
    }

    /// This arbiter granted hold `hold_key` (the grant transaction committed).
    pub(crate) fn granted_hold(&self, keys: &Keys, hold_key: &[u8]) {
        if self.book.active.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Some(d) = keys.digest_of_hold(hold_key) {
            self.book.granted(&d, false);
        }
    }

    fn leave(&self, d: &KeyDigest, id: u64) {
        self.book.ungate(d, id);
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = map.get_mut(d) {
            let was_head = q.order.front() == Some(&id);
            q.order.retain(|x| *x != id);
            if q.offer.as_ref().is_some_and(|o| o.ticket == id) {
                q.offer = None;
                HANDOFFS.offers.fetch_sub(1, Ordering::Relaxed);
            }
            if q.order.is_empty() {
                map.remove(d);
            } else if was_head {
                q.notify.notify_waiters();
            }
        }
    }
}

// === impl Ticket ===

impl Ticket<'_> {
    /// True when this waiter is first in line.
    pub(crate) fn is_head(&self) -> bool {
        self.queues.is_head(&self.digest, self.id)
    }

    /// Waits until first in line, the deadline (`Contended`) or cancellation.
    pub(crate) async fn wait_head(&self, deadline: Instant, cancel: &CancellationToken) -> Result<(), LockError> {
        let mut gated = false;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_head() {
                return Ok(());
            }
            if !gated {
                self.queues.gate(&self.digest, self.id, None);
                gated = true;
            }
            tokio::select! {
                _ = &mut notified => self.queues.woke(&self.digest),
                _ = tokio::time::sleep_until(deadline) => return Err(LockError::Contended(Reason::KeyGated)),
                _ = cancel.cancelled() => return Err(LockError::Cancelled),
            }
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.queues.leave(&self.digest, self.id);
    }
}

/// A short jittered pause after a transient conflict.
pub async fn backoff(deadline: Instant, cancel: &CancellationToken) -> Result<(), LockError> {
    let ms = rand::rng().random_range(5..40);
    let until = (Instant::now() + Duration::from_millis(ms)).min(deadline);
    tokio::select! {
        _ = tokio::time::sleep_until(until) => Ok(()),
        _ = cancel.cancelled() => Err(LockError::Cancelled),
    }
}

// === impl Store ===

impl Store {
    /// Posts head `ticket`'s offer of `req` on session `sid` (see the module docs),
    /// to be ended by [`Store::wait_offered`] or [`Store::settle_offer`]; until
    /// then a release of `d` here may grant it in the release's transaction.
    pub(crate) fn post_offer(
        &self,
        d: &KeyDigest,
        ticket: &Ticket<'_>,
        req: &AcquireRequest,
        sid: SessionId,
        record: Option<&SessionRecord>,
    ) -> PostedOffer {
        let (tx, rx) = oneshot::channel();
        let offered = self.queues().post_offer(d, ticket.id, req, sid, record, tx);
        PostedOffer { offered, rx }
    }

    /// Waits for a reason to retry a gated grant: a watch event on the key's
    /// holders after `revision`, a release through here, the poll, the deadline.
    /// While the offer `posted` ([`Store::post_offer`]) stands, a release through
    /// this arbiter may grant the waiter in the release transaction: then the
    /// grant is returned.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn wait_offered(
        &self,
        d: &KeyDigest,
        revision: i64,
        deadline: Instant,
        cancel: &CancellationToken,
        ticket: &Ticket<'_>,
        req: &AcquireRequest,
        posted: PostedOffer,
    ) -> Result<Option<Grant>, LockError> {
        self.queues().gate(d, ticket.id, Some(req));
        let PostedOffer { offered, mut rx } = posted;
        let outcome = self.wait_change_in(d, revision, deadline, cancel, ticket, offered, &mut rx).await;
        if let Some(g) = outcome.handed {
            self.queues().woke(d);
            self.queues().book.granted(d, true);
            return Ok(Some(g));
        }
        if !outcome.answered {
            if let Some(g) = self.settle_offer(d, ticket, PostedOffer { offered, rx }).await {
                self.queues().woke(d);
                return Ok(Some(g));
            }
        }
        if outcome.result.is_ok() {
            self.queues().woke(d);
        }
        outcome.result.map(|()| None)
    }

    /// Ends a posted offer that was not answered: withdrawn, or, when a releaser
    /// took it first, that releaser's answer (its transaction decides, and it
    /// always answers or drops the sender when its task ends): the grant it made.
    pub(crate) async fn settle_offer(&self, d: &KeyDigest, ticket: &Ticket<'_>, posted: PostedOffer) -> Option<Grant> {
        if !posted.offered || self.queues().withdraw_offer(d, ticket.id) {
            return None;
        }
        match posted.rx.await {
            Ok(Handed::Granted(g)) => {
                self.queues().book.granted(d, true);
                Some(g)
            }
            Ok(Handed::Retry) | Err(_) => None,
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn wait_change_in(
        &self,
        d: &KeyDigest,
        revision: i64,
        deadline: Instant,
        cancel: &CancellationToken,
        ticket: &Ticket<'_>,
        offered: bool,
        rx: &mut oneshot::Receiver<Handed>,
    ) -> WaitOutcome {
        if crate::test_faults::on(crate::test_faults::TestFault::WaiterSleepsToDeadline) {
            // PLANTED BUG (release gate): no hint wakes this waiter.
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {}
                _ = cancel.cancelled() => return WaitOutcome { handed: None, answered: false, result: Err(LockError::Cancelled) },
            }
            return WaitOutcome { handed: None, answered: false, result: Ok(()) };
        }
        let notified = ticket.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let poll = next_poll();
        let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        // With an offer posted, the release that ends this wait is most likely
        // one through here, which answers the offer; the watch (a watcher created
        // and cancelled on the store's stream, in etcd and here) is only for a
        // release elsewhere or an expiry. It starts WATCH_AFTER_OFFER later, from
        // the same revision, so it loses no event: on a hot key it is never
        // created at all.
        let watch = async {
            if offered {
                tokio::time::sleep(WATCH_AFTER_OFFER).await;
            }
            self.delete_seen(self.cluster.keys().holds(d), opts).await
        };
        let handed = async {
            if offered {
                return rx.await;
            }
            std::future::pending().await
        };
        let result = tokio::select! {
            h = handed => return match h {
                Ok(Handed::Granted(g)) => WaitOutcome { handed: Some(g), answered: true, result: Ok(()) },
                // Retry, or the releaser went away without answering.
                Ok(Handed::Retry) | Err(_) => WaitOutcome { handed: None, answered: true, result: Ok(()) },
            },
            _ = watch => Ok(()),
            _ = &mut notified => Ok(()),
            _ = tokio::time::sleep_until(poll.min(deadline)) => Ok(()),
            _ = cancel.cancelled() => Err(LockError::Cancelled),
        };
        WaitOutcome { handed: None, answered: false, result }
    }
}

/// When a gated waiter looks again without a hint: [`POLL`] from now, ±20 %
/// so waiters that started together do not poll together.
pub(super) fn next_poll() -> Instant {
    Instant::now() + POLL.mul_f64(rand::rng().random_range(0.8..1.2))
}

impl Store {
    /// Resolves when etcd reports a delete of `key` (of a key under it, with a
    /// prefix in `opts`) from `opts`' start revision on, or cancels the watch
    /// (compacted: look again now). Never resolves when the watch cannot be set up
    /// or breaks: a lost watch is only a lost hint, the caller's poll still runs.
    /// One watcher on the store's one watch stream ([`crate::watches`]).
    pub(super) async fn delete_seen(&self, key: impl Into<Vec<u8>>, opts: WatchOptions) {
        self.watches.delete_seen(&self.cluster.client(), key, opts).await;
    }
}

/// An offer posted by [`Store::post_offer`] and where its releaser answers.
pub(crate) struct PostedOffer {
    /// Whether it was posted (hand-off on, the ticket the head).
    offered: bool,
    rx: oneshot::Receiver<Handed>,
}

struct WaitOutcome {
    handed: Option<Grant>,
    /// The releaser answered (the receiver is spent).
    answered: bool,
    result: Result<(), LockError>,
}

// === the waiters' book ===

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bucket bounds of `lockmesh_arbiter_wakeups_per_grant`.
pub const WAKEUP_BUCKETS: &[f64] = &[0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// The bounded labels of a waiting key: its namespace when the registry names it
/// in a prefix (else `other`) and its class, as the lock metrics label it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WaitLabels {
    /// The namespace label.
    pub namespace: String,
    /// The class label.
    pub class: String,
}

impl WaitLabels {
    fn of(labels: &LockLabelSet, req: &AcquireRequest) -> Self {
        let (namespace, class) = labels.label(req.key.namespace(), req.class.name.as_str());
        Self { namespace, class }
    }
}

/// One key's gated waiters here, and what happened since its last grant here.
#[derive(Default)]
struct KeyWaits {
    labels: Option<Arc<WaitLabels>>,
    /// Gated waiters by id, with when each began waiting, in that order.
    gated: Vec<(u64, std::time::Instant)>,
    /// Wake-ups of its waiters since its last grant here.
    wakes: u64,
    /// When the release transaction of the key last began here.
    release_started: Option<std::time::Instant>,
    /// When the last release of the key through here that committed began.
    released: Option<std::time::Instant>,
}

/// The keys of one store with a gated waiter here (module docs, "The waiters' book").
#[derive(Default)]
pub(crate) struct WaitBook {
    keys: Mutex<HashMap<KeyDigest, KeyWaits>>,
    /// The quotas whose lock labels name a gated waiter's key.
    quotas: Arc<Quotas>,
    /// How many keys `keys` has: while 0, the release and grant paths stop at it.
    active: AtomicUsize,
}

/// Every store's book (stores live as long as the process; dead ones are skipped).
static BOOKS: Mutex<Vec<Weak<WaitBook>>> = Mutex::new(Vec::new());

// === impl WaitBook ===

impl WaitBook {
    fn new(quotas: Arc<Quotas>) -> Self {
        Self { quotas, ..Self::default() }
    }

    fn gate(&self, d: &KeyDigest, id: u64, req: Option<&AcquireRequest>) {
        let mut keys = lock(&self.keys);
        if !keys.contains_key(d) {
            keys.insert(d.clone(), KeyWaits::default());
            self.active.store(keys.len(), Ordering::Relaxed);
        }
        let Some(w) = keys.get_mut(d) else { return };
        if w.labels.is_none() {
            if let Some(req) = req {
                let labels = WaitLabels::of(&self.quotas.lock_labels(), req);
                FIGURES.of(&labels);
                w.labels = Some(Arc::new(labels));
            }
        }
        if !w.gated.iter().any(|(i, _)| *i == id) {
            w.gated.push((id, std::time::Instant::now()));
        }
    }

    fn ungate(&self, d: &KeyDigest, id: u64) {
        if self.active.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut keys = lock(&self.keys);
        if let Some(w) = keys.get_mut(d) {
            w.gated.retain(|(i, _)| *i != id);
            if w.gated.is_empty() {
                keys.remove(d);
                self.active.store(keys.len(), Ordering::Relaxed);
            }
        }
    }

    fn with(&self, d: &KeyDigest, f: impl FnOnce(&mut KeyWaits)) {
        if self.active.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Some(w) = lock(&self.keys).get_mut(d) {
            f(w);
        }
    }

    fn woke(&self, d: &KeyDigest) {
        self.with(d, |w| w.wakes += 1);
    }

    fn release_begins(&self, d: &KeyDigest) {
        self.with(d, |w| w.release_started = Some(std::time::Instant::now()));
    }

    fn released(&self, d: &KeyDigest) {
        self.with(d, |w| w.released = Some(w.release_started.take().unwrap_or_else(std::time::Instant::now)));
    }

    /// `d` was granted here: by hand-off in a release transaction (`handed`), or
    /// by a grant transaction. Observes the wake-ups since its last grant and the
    /// pickup latency from the release that freed it, if one went through here.
    fn granted(&self, d: &KeyDigest, handed: bool) {
        let mut seen = None;
        self.with(d, |w| {
            let wakes = std::mem::take(&mut w.wakes);
            let from = if handed { w.release_started.take() } else { w.released.take() };
            w.released = None;
            seen = w.labels.clone().map(|l| (l, wakes, from));
        });
        if let Some((labels, wakes, from)) = seen {
            FIGURES.of(&labels).observe(wakes, from.map(|t| t.elapsed()));
        }
    }
}

/// The wake-ups per grant and pickup latency histograms of one label pair, and
/// their counts and sums (what the console shows).
#[derive(Clone, Debug)]
pub struct Figures {
    /// `lockmesh_arbiter_wakeups_per_grant`.
    pub wakeups: Histogram,
    /// `lockmesh_arbiter_pickup_latency_seconds`.
    pub pickup: Histogram,
    totals: Arc<[AtomicU64; 4]>,
}

/// The counts and sums of one label pair's [`Figures`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FigureTotals {
    /// Grants observed (the wake-ups histogram's count).
    pub grants: u64,
    /// Wake-ups over those grants (its sum).
    pub wakeups: u64,
    /// Pickups observed (the pickup histogram's count).
    pub pickups: u64,
    /// Their sum, µs.
    pub pickup_us: u64,
}

// === impl Figures ===

impl Figures {
    /// One grant after `wakes` wake-ups, `pickup` after the release that freed it
    /// (when one went through here).
    fn observe(&self, wakes: u64, pickup: Option<Duration>) {
        let t = &self.totals;
        self.wakeups.observe(wakes as f64);
        t[0].fetch_add(1, Ordering::Relaxed);
        t[1].fetch_add(wakes, Ordering::Relaxed);
        if let Some(p) = pickup {
            self.pickup.observe(p.as_secs_f64());
            t[2].fetch_add(1, Ordering::Relaxed);
            t[3].fetch_add(u64::try_from(p.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
        }
    }

    /// The counts and sums so far.
    pub fn totals(&self) -> FigureTotals {
        let [grants, wakeups, pickups, pickup_us] = self.totals.each_ref().map(|a| a.load(Ordering::Relaxed));
        FigureTotals { grants, wakeups, pickups, pickup_us }
    }
}

/// The histograms of every label pair a waiting key had here (process-wide; the
/// label pairs are bounded by the registry).
pub struct WaitFigures {
    by: Mutex<BTreeMap<WaitLabels, Figures>>,
}

/// This process's [`WaitFigures`].
pub static FIGURES: LazyLock<WaitFigures> = LazyLock::new(|| WaitFigures { by: Mutex::new(BTreeMap::new()) });

// === impl WaitFigures ===

impl WaitFigures {
    /// The histograms of `labels` (created at 0 on first use).
    pub fn of(&self, labels: &WaitLabels) -> Figures {
        let mut by = lock(&self.by);
        if let Some(f) = by.get(labels) {
            return f.clone();
        }
        let f = Figures {
            wakeups: Histogram::new(WAKEUP_BUCKETS.iter().copied()),
            pickup: Histogram::new(lockmesh_telemetry::labels::LATENCY_BUCKETS.iter().copied()),
            totals: Arc::default(),
        };
        by.insert(labels.clone(), f.clone());
        f
    }

    /// Every label pair's histograms, by labels.
    pub fn all(&self) -> Vec<(WaitLabels, Figures)> {
        lock(&self.by).iter().map(|(l, f)| (l.clone(), f.clone())).collect()
    }
}

/// Gated waiters of one label pair on this arbiter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gated {
    /// Waiters waiting now.
    pub waiters: u64,
    /// How long the oldest of them has been waiting, ms (0 without one).
    pub oldest_ms: u64,
}

/// The gated waiters of every store here by label pair, with every pair that ever
/// had one here and every pair `labels` (the registry's prefixes) declare (at 0).
pub fn gated(labels: &LockLabelSet) -> BTreeMap<WaitLabels, Gated> {
    let mut out: BTreeMap<WaitLabels, Gated> = BTreeMap::new();
    for (namespace, class) in labels.pairs() {
        out.insert(WaitLabels { namespace: namespace.clone(), class: class.clone() }, Gated::default());
    }
    for (labels, _) in FIGURES.all() {
        out.entry(labels).or_default();
    }
    let books: Vec<Arc<WaitBook>> = lock(&BOOKS).iter().filter_map(Weak::upgrade).collect();
    let now = std::time::Instant::now();
    for b in books {
        for w in lock(&b.keys).values() {
            let (Some(labels), Some((_, since))) = (&w.labels, w.gated.first()) else { continue };
            let g = out.entry(WaitLabels::clone(labels)).or_default();
            g.waiters += w.gated.len() as u64;
            g.oldest_ms = g.oldest_ms.max(u64::try_from(now.duration_since(*since).as_millis()).unwrap_or(u64::MAX));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(key: &str) -> KeyDigest {
        lockmesh_core::LockKey::parse(key.as_bytes()).unwrap().digest()
    }

    /// A book whose key `d` waits under `labels` (as a gated head's request would
    /// label it), with waiter `id` gated.
    fn labelled(b: &WaitBook, d: &KeyDigest, id: u64, labels: &WaitLabels) {
        b.gate(d, id, None);
        lock(&b.keys).get_mut(d).unwrap().labels = Some(Arc::new(labels.clone()));
        FIGURES.of(labels);
    }

    #[test]
    fn the_book_counts_wakeups_per_grant_and_the_pickup_from_the_release() {
        let labels = WaitLabels { namespace: "book-test".into(), class: "wakeups".into() };
        let (b, d) = (WaitBook::default(), digest("book-test/k1"));
        // Nothing is kept for a key without a gated waiter.
        b.woke(&d);
        b.release_begins(&d);
        assert_eq!(b.active.load(Ordering::Relaxed), 0);
        labelled(&b, &d, 1, &labels);
        b.gate(&d, 2, None);
        b.gate(&d, 1, None);
        assert_eq!(lock(&b.keys)[&d].gated.len(), 2, "a waiter gated again is one waiter");
        for _ in 0..3 {
            b.woke(&d);
        }
        b.release_begins(&d);
        std::thread::sleep(Duration::from_millis(30));
        b.released(&d);
        b.granted(&d, false);
        let f = FIGURES.of(&labels);
        let t = f.totals();
        assert_eq!((t.grants, t.wakeups, t.pickups), (1, 3, 1));
        assert!(t.pickup_us >= 30_000, "from the start of the release: {t:?}");
        // The next grant without a release here since: wake-ups, no pickup.
        b.woke(&d);
        b.granted(&d, false);
        let t = f.totals();
        assert_eq!((t.grants, t.wakeups, t.pickups), (2, 4, 1));
        // A hand-off: from the start of its release transaction.
        b.release_begins(&d);
        b.woke(&d);
        b.granted(&d, true);
        let t = f.totals();
        assert_eq!((t.grants, t.wakeups, t.pickups), (3, 5, 2));
        b.ungate(&d, 1);
        b.ungate(&d, 2);
        assert!(lock(&b.keys).is_empty());
        assert_eq!(b.active.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn the_oldest_gated_waiter_is_the_first_still_waiting() {
        let labels = WaitLabels { namespace: "book-test".into(), class: "oldest".into() };
        let (b, d) = (Arc::new(WaitBook::default()), digest("book-test/k2"));
        lock(&BOOKS).push(Arc::downgrade(&b));
        labelled(&b, &d, 1, &labels);
        std::thread::sleep(Duration::from_millis(40));
        b.gate(&d, 2, None);
        let g = gated(&LockLabelSet::default()).remove(&labels).unwrap();
        assert_eq!(g.waiters, 2);
        assert!(g.oldest_ms >= 40, "{g:?}");
        b.ungate(&d, 1);
        let g = gated(&LockLabelSet::default()).remove(&labels).unwrap();
        assert_eq!(g.waiters, 1);
        assert!(g.oldest_ms < 40, "the first left: {g:?}");
        b.ungate(&d, 2);
        assert_eq!(gated(&LockLabelSet::default()).remove(&labels), Some(Gated::default()), "the pair stays, at 0");
    }
}
