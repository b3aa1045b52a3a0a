//! The filter's state in one root context of one worker VM, and the host glue around
//! the pure [`Queues`]: Tier-1 local limits, the Envoy-wide backlog, pausing,
//! hand-over and expiry. Every host-call failure fails closed (the request is
//! refused, nothing is forwarded) or, for cleanup, is logged and left to the roster's
//! staleness bound.
//!
//! # Tier-1 local limits (approximate)
//!
//! `local_limits` caps the acquire requests for keys under a prefix that are inside
//! **one Envoy** at once, queued in the filter or waiting at the arbiter, counted in
//! shared data across its workers (a roster per prefix, updated by CAS). A request over
//! the limit is answered `429 queue_full` (`x-lockmesh-error: queue_full`,
//! `retry-after: 1`, message "the key's prefix is at its local in-flight limit"),
//! counted as outcome `limited_approx`. It is a load-shedding bound, exact per Envoy
//! and approximate across the fleet: the fleet-wide bound is `max_in_flight x
//! lock-tier Envoy replicas`. It is also approximate over time: a slot is held from
//! admission to the request's end (`on_done`), and a slot a trapped VM never gave back
//! is reclaimed only `max_wait_ms + 60 s` after it was taken. Releases and other
//! routes are never limited. Why `queue_full` rather than `contended`: try-lock
//! callers read `contended` as "someone else holds it, skip the work", which would be
//! wrong for a shed request whose key may be free; `queue_full` says "back off and
//! retry", which is right.

use std::rc::Rc;

use lockmesh_core::{code::error_body, headers, Code, LockKey, Reason};
use proxy_wasm::{
    hostcalls,
    types::{LogLevel, MapType, Status},
};

use crate::{
    abi,
    config::Config,
    metrics::{Metrics, Outcome},
    queue::{Admission, Left, Promotion, Queues, Waiter},
    roster::{backlog_bucket, limit_roster, Entry, BACKLOG_GRACE_MS},
    shared,
    transparent::{new_vm_id, Call, Holds},
};

/// How long past `max_wait_ms` a local-limit slot can be held before it is stale.
pub(crate) const SLOT_SLACK_MS: u64 = 60_000;
/// The record name inside a local-limit roster.
const SLOTS: &str = "slots";
/// The body message of a `409 contended` answered by the filter (as the arbiter's).
pub(crate) const CONTENDED_MESSAGE: &str = "the key is held";

/// One root context's state, shared with its HTTP contexts.
pub struct Worker {
    root_id: u32,
    config: Option<Rc<Config>>,
    owner: Option<u32>,
    queues: Queues,
    metrics: Metrics,
    /// Transparent mode (created with the first transparent request).
    holds: Option<Holds>,
    /// This root's wake-up queue: other workers and this worker's finished requests
    /// post to it, so hand-overs and releases do not wait for the tick.
    wake: Option<u32>,
}

/// What an admitted acquire holds until its request ends ([`Worker::finish`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    key: String,
    limit: Option<String>,
    /// A transparent request's hold number.
    hold: Option<u64>,
}

/// A wake-up item: run the releases due.
const WAKE_RELEASES: &[u8] = b"r";
/// A wake-up item prefix: pass this key's next waiter on (the key follows).
const WAKE_KEY: &[u8] = b"k:";

/// The name of the wake-up queue of the root with owner tag `owner`.
fn wake_queue_name(owner: u32) -> String {
    format!("lockmesh.wake.{owner}")
}

/// What the HTTP context does with an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Continue with this budget (ms) in `x-lockmesh-budget-ms`.
    Forward { budget_ms: u64 },
    /// Pause: it is queued.
    Pause,
    /// Answer locally.
    Refuse(Refusal),
}

/// A local answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// HTTP status.
    pub status: u32,
    /// Stable code.
    pub code: Code,
    /// JSON body.
    pub body: String,
    /// The metric outcome.
    pub outcome: Outcome,
}

impl Refusal {
    fn new(code: Code, message: &str, reason: Option<Reason>, outcome: Outcome) -> Self {
        Self { status: u32::from(code.http_status()), code, body: error_body(code, message, reason), outcome }
    }
    fn contended() -> Self {
        Self::new(Code::Contended, CONTENDED_MESSAGE, Some(Reason::KeyGated), Outcome::ContendedLocal)
    }
    /// A filter failure: nothing was forwarded.
    pub fn internal() -> Self {
        Self::new(Code::Internal, "lock filter error", None, Outcome::Internal)
    }
}

/// Wall-clock milliseconds (the host's clock, shared by every worker).
pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, &format!("lockmesh: {msg}"));
}

/// Answers `ctx`'s request locally, from any context.
pub(crate) fn reply_to(ctx: u32, r: &Refusal) {
    if hostcalls::set_effective_context(ctx).is_err() {
        return; // gone: nobody to answer
    }
    reply(r);
}

/// Answers the effective context's request locally.
pub fn reply(r: &Refusal) {
    // `x-lockmesh-error` and, for the codes that carry it, `retry-after`: the
    // same headers as the arbiter's answers (core's one table).
    let mut hdrs = vec![("content-type", "application/json")];
    hdrs.extend(r.code.error_headers());
    if let Err(e) = abi::send_http_response(r.status, &hdrs, r.body.as_bytes()) {
        log(LogLevel::Warn, &format!("local reply failed: status {}", e.0));
    }
}

// === impl Worker ===

impl Worker {
    /// The state of root context `root_id`, not configured yet.
    pub fn new(root_id: u32) -> Self {
        Self {
            root_id,
            config: None,
            owner: None,
            queues: Queues::default(),
            metrics: Metrics::default(),
            holds: None,
            wake: None,
        }
    }

    /// A hold number for a transparent request, and this VM's id.
    pub(crate) fn open_hold(&mut self, now: u64) -> Result<(String, u64), Status> {
        if self.holds.is_none() {
            let owner = self.owner()?;
            let ns = hostcalls::get_current_time()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            self.holds = Some(Holds::new(new_vm_id(ns, owner ^ self.root_id.rotate_left(16))));
        }
        let h = self.holds.as_mut().ok_or(Status::InternalFailure)?;
        let n = h.open(now);
        Ok((h.vm().to_owned(), n))
    }

    /// Registers this root's wake-up queue (on its own worker thread: the tick).
    pub(crate) fn register_wake(&mut self) {
        if self.wake.is_some() {
            return;
        }
        let Ok(owner) = self.owner() else { return };
        match hostcalls::register_shared_queue(&wake_queue_name(owner)) {
            Ok(q) => self.wake = Some(q),
            Err(e) => log(LogLevel::Warn, &format!("no wake-up queue ({e:?}); hand-overs wait for the tick")),
        }
    }

    /// Posts `item` to the wake-up queue of the root with owner tag `owner`.
    fn wake(&self, owner: u32, item: &[u8]) {
        let q = if Some(owner) == self.owner {
            self.wake
        } else {
            hostcalls::resolve_shared_queue("", &wake_queue_name(owner)).ok().flatten()
        };
        if let Some(q) = q {
            let _ = hostcalls::enqueue_shared_queue(q, Some(item));
        }
    }

    /// Drains wake-up queue `queue`: releases due and keys to pass on.
    pub(crate) fn on_wake(&mut self, queue: u32, now: u64) {
        if Some(queue) != self.wake {
            return;
        }
        let mut keys = Vec::new();
        while let Ok(Some(item)) = hostcalls::dequeue_shared_queue(queue) {
            if let Some(k) = item.strip_prefix(WAKE_KEY) {
                if let Ok(k) = std::str::from_utf8(k) {
                    keys.push(k.to_owned());
                }
            }
        }
        keys.sort_unstable();
        keys.dedup();
        for k in keys {
            self.pump(&k, now);
        }
    }

    /// Makes the transparent-mode calls that are due (releases, keepalive). Called
    /// from the root context with the root as the effective context, so the calls
    /// are bound to the root and outlive any request.
    pub fn calls(&mut self, now: u64) {
        let (Some(cfg), Some(holds)) = (self.config.clone(), self.holds.as_mut()) else {
            return;
        };
        let Some(t) = cfg.transparent.as_ref() else { return };
        let timeout = std::time::Duration::from_millis(t.callout_timeout_ms);
        let send = |path: &str, body: &[u8]| {
            let hdrs = vec![
                (":method", "POST"),
                (":path", path),
                (":authority", t.arbiter_authority.as_str()),
                ("content-type", "application/json"),
            ];
            hostcalls::dispatch_http_call(&t.arbiter_cluster, hdrs, Some(body), vec![], timeout)
        };
        for r in holds.due_releases(now) {
            let call = Call::Release(r.clone());
            match send(crate::transparent::RELEASE_PATH, &holds.release_body(&r)) {
                Ok(token) => holds.sent(token, call, now),
                Err(e) => {
                    log(LogLevel::Warn, &format!("a release call could not be made ({e:?}); retrying"));
                    holds.not_sent(call, now);
                }
            }
        }
        if let Some(reconcile) = holds.keepalive_due(now, t.reconcile_every_ms) {
            let body = holds.keepalive_body(reconcile);
            for _ in 0..holds.keepalive_calls() {
                let call = Call::Keepalive { reconcile };
                match send(crate::transparent::KEEPALIVE_PATH, &body) {
                    Ok(token) => holds.sent(token, call, now),
                    Err(e) => {
                        log(LogLevel::Warn, &format!("a keepalive call could not be made ({e:?}); retrying"));
                        holds.not_sent(call, now);
                    }
                }
            }
        }
    }

    /// The answer to callout `token` (read from the host's call response).
    pub(crate) fn on_call_response(&mut self, token: u32, body_size: usize, now: u64) {
        let Some(holds) = self.holds.as_mut() else { return };
        let status = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| std::str::from_utf8(&s).ok().and_then(|s| s.parse::<u32>().ok()))
            .unwrap_or(0);
        let body = if body_size > 0 {
            hostcalls::get_buffer(proxy_wasm::types::BufferType::HttpCallResponseBody, 0, body_size.min(65_536))
                .ok()
                .flatten()
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        match holds.answered(token, status, &body, now) {
            Some(Call::Release(_)) if status != 200 => {
                self.metrics.release(false);
                log(LogLevel::Warn, &format!("a transparent release failed with status {status}; retrying"));
            }
            Some(Call::Release(_)) => self.metrics.release(true),
            Some(Call::Keepalive { .. }) if status != 200 => {
                log(LogLevel::Warn, &format!("the VM keepalive failed with status {status}; retrying"));
            }
            _ => {}
        }
    }

    /// The root context id.
    pub(crate) fn root_id(&self) -> u32 {
        self.root_id
    }

    /// Installs a validated configuration.
    pub fn configure(&mut self, config: Config) {
        self.config = Some(Rc::new(config));
    }

    /// The configuration (`None` before `on_configure` succeeded).
    pub fn config(&self) -> Option<Rc<Config>> {
        self.config.clone()
    }

    pub fn metrics(&mut self) -> &mut Metrics {
        &mut self.metrics
    }

    fn owner(&mut self) -> Result<u32, Status> {
        if let Some(o) = self.owner {
            return Ok(o);
        }
        let o = shared::new_owner_tag()?;
        self.owner = Some(o);
        Ok(o)
    }

    /// Admits acquire `ctx` for `key`: its local limit, then its key's queue.
    pub(crate) fn admit(
        &mut self,
        cfg: &Config,
        ctx: u32,
        key: &LockKey,
        wait_ms: u64,
        hold: Option<u64>,
        now: u64,
    ) -> (Step, Option<Ticket>) {
        let Ok(owner) = self.owner() else {
            return (Step::Refuse(Refusal::internal()), None);
        };
        let mut ticket = Ticket { key: key.as_str().to_owned(), limit: None, hold };
        if let Some(l) = cfg.local_limit(key) {
            let entry = Entry { owner, ctx, expires_ms: now + cfg.max_wait_ms + SLOT_SLACK_MS };
            let max = usize::try_from(l.max_in_flight).unwrap_or(usize::MAX);
            let taken = shared::update_roster(&limit_roster(&l.prefix), now, |r| {
                let free = r.live(SLOTS, now) < max;
                if free {
                    r.push(SLOTS, entry);
                }
                free
            });
            match taken {
                Ok(true) => ticket.limit = Some(l.prefix.clone()),
                Ok(false) => {
                    let r = Refusal::new(
                        Code::QueueFull,
                        "the key's prefix is at its local in-flight limit",
                        None,
                        Outcome::LimitedApprox,
                    );
                    return (Step::Refuse(r), None);
                }
                Err(_) => return (Step::Refuse(Refusal::internal()), None),
            }
        }
        let bucket = backlog_bucket(&ticket.key);
        let older_elsewhere = match shared::read_roster(&bucket) {
            Ok(r) => r.first_live(&ticket.key, now).is_some(),
            Err(_) => return self.refuse(ctx, ticket, Refusal::internal(), now),
        };
        let max_queue = cfg.max_queue_per_key;
        match self.queues.admit(&ticket.key, ctx, now, wait_ms, older_elsewhere, max_queue) {
            Admission::Forward => (Step::Forward { budget_ms: wait_ms }, Some(ticket)),
            Admission::Queued => {
                let entry = Entry { owner, ctx, expires_ms: now + wait_ms + BACKLOG_GRACE_MS };
                let k = ticket.key.clone();
                if shared::update_roster(&bucket, now, |r| r.push(&k, entry)).is_err() {
                    self.queues.leave(&ticket.key, ctx);
                    return self.refuse(ctx, ticket, Refusal::internal(), now);
                }
                self.metrics.queue_depth(cfg.ns_label(Some(&ticket.key)), 1);
                (Step::Pause, Some(ticket))
            }
            Admission::Contended => self.refuse(ctx, ticket, Refusal::contended(), now),
            Admission::QueueFull => {
                let r = Refusal::new(
                    Code::QueueFull,
                    "too many requests are queued for this key",
                    None,
                    Outcome::QueueFull,
                );
                self.refuse(ctx, ticket, r, now)
            }
        }
    }

    /// Refuses after a slot may have been taken: gives the slot back.
    fn refuse(&mut self, ctx: u32, ticket: Ticket, r: Refusal, now: u64) -> (Step, Option<Ticket>) {
        self.release_slot(ctx, ticket.limit.as_deref(), now);
        self.end_hold(&ticket, false, now);
        (Step::Refuse(r), None)
    }

    /// A transparent request ended; a release is queued if it reached the arbiter.
    fn end_hold(&mut self, ticket: &Ticket, forwarded: bool, now: u64) {
        let (Some(n), Some(holds)) = (ticket.hold, self.holds.as_mut()) else {
            return;
        };
        if holds.end(&ticket.key, n, forwarded, now) {
            if let Some(owner) = self.owner {
                self.wake(owner, WAKE_RELEASES);
            }
        }
    }

    fn release_slot(&mut self, ctx: u32, limit: Option<&str>, now: u64) {
        let (Some(prefix), Some(owner)) = (limit, self.owner) else {
            return;
        };
        if shared::update_roster(&limit_roster(prefix), now, |r| r.remove(SLOTS, owner, ctx)).is_err() {
            log(LogLevel::Warn, "a local-limit slot could not be given back; it goes stale");
        }
    }

    /// The request of `ctx` ended (`on_done`, or the context was dropped): gives back
    /// its slot and its place, and hands the key to the next waiter.
    pub fn finish(&mut self, ctx: u32, ticket: Ticket, now: u64) {
        self.release_slot(ctx, ticket.limit.as_deref(), now);
        match self.queues.leave(&ticket.key, ctx) {
            Left::InFlight { queued } => {
                self.end_hold(&ticket, true, now);
                // Only a promoted waiter has a backlog entry (kept until now); a
                // request forwarded at admission costs no shared-data read here.
                if queued {
                    self.drop_backlog_entry(&ticket.key, ctx, now);
                }
                self.pump(&ticket.key, now);
                // Only when nothing of ours is in flight for the key: waking another
                // worker while our next waiter travels to the arbiter would let both
                // race there, and arrival order could swap them.
                if self.queues.in_flight(&ticket.key).is_none() {
                    self.wake_next_elsewhere(&ticket.key, now);
                }
            }
            Left::Waiting(w) => {
                self.end_hold(&ticket, false, now);
                self.left_queue(&ticket.key, &w, now);
                self.count(&ticket.key, Outcome::Cancelled);
            }
            Left::Absent => self.end_hold(&ticket, false, now),
        }
    }

    /// When the key's oldest waiter in this Envoy sits on another worker, wakes that
    /// worker now instead of leaving it to its tick.
    fn wake_next_elsewhere(&self, key: &str, now: u64) {
        let Some(me) = self.owner else { return };
        let Ok(backlog) = shared::read_roster(&backlog_bucket(key)) else { return };
        if let Some(first) = backlog.first_live(key, now).filter(|e| e.owner != me) {
            self.wake(first.owner, &[WAKE_KEY, key.as_bytes()].concat());
        }
    }

    /// The periodic tick: answers waiters past their deadline, and passes on heads
    /// that became first in the backlog through another worker.
    pub fn tick(&mut self, now: u64) {
        for (key, w) in self.queues.expire(now) {
            self.left_queue(&key, &w, now);
            self.count(&key, Outcome::ContendedLocal);
            reply_to(w.ctx, &Refusal::contended());
        }
        for key in self.queues.keys_with_waiters() {
            self.pump(&key, now);
        }
    }

    fn count(&mut self, key: &str, outcome: Outcome) {
        let Some(cfg) = self.config.clone() else {
            return;
        };
        self.metrics.request(cfg.ns_label(Some(key)), outcome);
    }

    /// Bookkeeping for a waiter leaving the queue unanswered by the arbiter: backlog
    /// entry, gauge, histogram.
    fn left_queue(&mut self, key: &str, w: &Waiter, now: u64) {
        self.drop_backlog_entry(key, w.ctx, now);
        self.queue_metrics(key, w, now);
    }

    /// Removes `ctx`'s entry from the key's backlog, if it has one (a request
    /// forwarded without queueing never had one).
    fn drop_backlog_entry(&mut self, key: &str, ctx: u32, now: u64) {
        let Some(owner) = self.owner else { return };
        let bucket = backlog_bucket(key);
        if shared::read_roster(&bucket).is_ok_and(|r| !r.contains(key, owner, ctx)) {
            return;
        }
        if shared::update_roster(&bucket, now, |r| r.remove(key, owner, ctx)).is_err() {
            log(LogLevel::Warn, "a backlog entry could not be removed; it goes stale");
        }
    }

    /// The gauge and the queue-wait histogram, for a waiter leaving the queue.
    fn queue_metrics(&mut self, key: &str, w: &Waiter, now: u64) {
        if let Some(cfg) = self.config.clone() {
            let ns = cfg.ns_label(Some(key));
            self.metrics.queue_depth(ns, -1);
            self.metrics.queue_wait(ns, now.saturating_sub(w.received_ms));
        }
    }

    /// Passes `key`'s next waiter on if the head slot is free and it is first in the
    /// Envoy-wide backlog; answers expired waiters met on the way. Leaves the
    /// effective context on whatever it last touched: callers restore their own.
    fn pump(&mut self, key: &str, now: u64) {
        let Some(owner) = self.owner else {
            return;
        };
        loop {
            // Unreadable backlog: pass the head on rather than strand it (order is
            // best effort, liveness is not).
            let backlog = shared::read_roster(&backlog_bucket(key)).unwrap_or_default();
            let first = backlog.first_live(key, now);
            let is_first = |ctx: u32| match first {
                None => true,
                Some(e) => (e.owner, e.ctx) == (owner, ctx) || !backlog.contains(key, owner, ctx),
            };
            let Some(p) = self.queues.promote(key, now, is_first) else {
                return;
            };
            match p {
                Promotion::Expired(w) => {
                    self.left_queue(key, &w, now);
                    self.count(key, Outcome::ContendedLocal);
                    reply_to(w.ctx, &Refusal::contended());
                }
                Promotion::Forward { waiter, budget_ms } => {
                    // Its backlog entry stays until its request completes (`finish`):
                    // while it travels to the arbiter no other worker's waiter is
                    // first, so none can race it there and arrive before it.
                    self.queue_metrics(key, &waiter, now);
                    match hand_over(waiter.ctx, budget_ms) {
                        HandOver::Resumed => {
                            self.count(key, Outcome::Forwarded);
                            return;
                        }
                        HandOver::Gone => {
                            self.drop_backlog_entry(key, waiter.ctx, now);
                            self.queues.leave(key, waiter.ctx);
                            self.count(key, Outcome::Cancelled);
                        }
                        HandOver::Failed => {
                            self.drop_backlog_entry(key, waiter.ctx, now);
                            self.queues.leave(key, waiter.ctx);
                            self.count(key, Outcome::Internal);
                            reply(&Refusal::internal());
                        }
                    }
                }
            }
        }
    }
}

enum HandOver {
    Resumed,
    /// The context no longer exists (its caller left): skip it.
    Gone,
    /// The context exists but could not be resumed; it is now the effective context.
    Failed,
}

/// Resumes paused request `ctx` with `budget_ms` left (docs/DECISIONS.md F-8: check
/// `set_effective_context` before anything else; a dead context returns `Err`).
fn hand_over(ctx: u32, budget_ms: u64) -> HandOver {
    if hostcalls::set_effective_context(ctx).is_err() {
        return HandOver::Gone;
    }
    let budget = budget_ms.to_string();
    if abi::set_request_header(headers::BUDGET_MS, &budget).is_err() || abi::resume_http_request().is_err() {
        log(LogLevel::Error, "a queued request could not be resumed");
        return HandOver::Failed;
    }
    HandOver::Resumed
}
