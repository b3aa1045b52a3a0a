//! Key-affine FIFO queueing of acquire requests in the filter (ADR-14): the queues
//! of one worker, as a plain data structure with explicit time inputs. The host glue
//! ([`crate::worker`]) pauses and resumes requests and keeps the Envoy-wide backlog
//! ([`crate::roster`]) in step with it.
//!
//! # Who orders what
//!
//! - **The filter, one worker (this module).** Per key, a FIFO of paused acquire
//!   requests (`POST /v1/locks/acquire`). Only the head is passed on to the arbiter;
//!   when the head's request completes (answered, failed, or its caller gone:
//!   `on_done`), the next waiter is resumed with `x-lockmesh-budget-ms` set to its
//!   wait minus the time it spent queued, which is where the arbiter counts its
//!   deadline from. A waiter whose deadline passes in the queue is answered
//!   `409 contended` (`key_gated`) by the filter at the next tick (100 ms) and leaves;
//!   one that disconnects leaves at once. A try-once (`x-lock-wait-ms` 0 or absent)
//!   never waits and never overtakes: while anyone is in flight or queued for its key
//!   on this worker, or queued on another worker of this Envoy, it is answered
//!   `409 contended` at once. A key's queue holds at most `max_queue_per_key` waiters
//!   (per worker); one more is answered `429 queue_full`. Release, keepalive,
//!   inspect, session and token routes never enter a queue, so they never wait
//!   behind waiters.
//! - **The filter, one Envoy (the backlog).** The workers of one Envoy share, per key,
//!   a backlog of their queued waiters in proxy-wasm shared data, in the order they
//!   were queued. A waiter stays in the backlog after it is passed on, until its
//!   request completes. A worker passes its head on only when nothing of its own is
//!   in flight for the key *and* its head is the oldest entry in the backlog; a new
//!   request queues, instead of going straight on, while the backlog holds an older
//!   entry on any worker. One Envoy therefore hands a key's queued waiters to the
//!   arbiter one at a time, in the order it received them, across workers: a waiter
//!   passed on cannot be raced to the arbiter by the next one on another worker
//!   (with the entry dropped at hand-over, a loaded Envoy let waiter 3 on worker B
//!   arrive before waiter 2 on worker A, handed over moments earlier). The worker
//!   whose request completed wakes the worker holding the next entry at once; the
//!   tick (100 ms) is the fallback.
//! - **The arbiter.** Envoy ring-hashes every ext_proc stream on `x-lock-key`, so the
//!   heads from every worker of every Envoy meet on one arbiter, which keeps them in
//!   a FIFO by arrival and grants in that order.
//!
//! Why the combination grants a key in the order one Envoy received its acquires
//! (arrivals spaced wider than the hand-over latency, milliseconds): the arbiter
//! holds at most one request per worker per key, the backlog makes the Envoy hand its
//! waiters over in receipt order, and the arbiter grants in arrival order. A waiter is
//! handed over the moment its predecessor on that worker is answered, before that
//! predecessor's caller can even send its release, so it is at the arbiter before the
//! key frees again. (Per-worker head-only forwarding alone does not suffice: with
//! waiters 1 and 2 on worker A and 3 on worker B, 3 reaches the arbiter while 2 still
//! waits behind 1 in A's filter, and 3 would be granted before 2.)
//!
//! Best effort only:
//! - **Across Envoys.** A waiter queued in one Envoy's filter (behind its worker's head)
//!   can be overtaken by a later request that another Envoy passes on directly: the
//!   arbiter orders by arrival, and cannot see waiters still in a filter.
//! - **Envoy restarts.** Queues and the backlog live in the Envoy process; they are
//!   lost with it, the waiters' connections drop, and callers retry.
//! - **VM traps.** Requests paused in a trapped VM are never resumed (the HCM
//!   `request_timeout` ends them); its backlog entries stay until their deadline plus
//!   2 s and hold back that key's waiters on the other workers for at most that long.
//! - **Ring changes and arbiter restarts.** While the arbiter ring changes, a key's
//!   waiters can sit on two arbiters, each FIFO on its own; an arbiter restart loses
//!   its FIFO (ADR-14).
//! - **Simultaneous arrivals** (closer than the hand-over latency) may be granted in
//!   either order.

use std::collections::{BTreeMap, VecDeque};

/// The acquire queues of one worker, by lock key.
#[derive(Debug, Default)]
pub struct Queues {
    keys: BTreeMap<String, KeyQueue>,
    /// `(deadline ms, context id)` of every waiter, for expiry in deadline order.
    deadlines: BTreeMap<(u64, u32), String>,
}

/// A paused acquire request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiter {
    /// The HTTP context id (unique within this VM).
    pub ctx: u32,
    /// When the filter received it, ms (the clock of the `now` inputs).
    pub received_ms: u64,
    /// `x-lock-wait-ms`.
    pub wait_ms: u64,
}

/// What to do with a new acquire request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Pass it on now with its whole wait as budget; it is the key's head here.
    Forward,
    /// It was queued: pause it.
    Queued,
    /// A try-once that would overtake: answer `409 contended` at once.
    Contended,
    /// The key's queue is full: answer `429 queue_full`.
    QueueFull,
}

/// What [`Queues::leave`] removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Left {
    /// The key's head (in flight): the next waiter may now be promoted.
    /// `queued`: it reached the head from the queue ([`Queues::promote`]), so it
    /// has an Envoy-wide backlog entry to remove; a request forwarded at admission
    /// never had one.
    InFlight { queued: bool },
    /// A waiter, still paused (its caller went away).
    Waiting(Waiter),
    /// Nothing: the context was not (or no longer) in the queue.
    Absent,
}

/// The next step for a key whose head slot is free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Promotion {
    /// Resume this waiter with `budget_ms` left; it is now the key's head.
    Forward {
        waiter: Waiter,
        /// Its wait minus the time it spent queued (at least 1).
        budget_ms: u64,
    },
    /// This waiter's deadline passed while it was queued: answer it `409`.
    Expired(Waiter),
}

#[derive(Debug, Default)]
struct KeyQueue {
    in_flight: Option<u32>,
    /// Whether the head in flight was promoted from `waiting`.
    promoted: bool,
    waiting: VecDeque<Waiter>,
}

// === impl Waiter ===

impl Waiter {
    /// When its wait ends, ms.
    pub(crate) fn deadline_ms(&self) -> u64 {
        self.received_ms.saturating_add(self.wait_ms)
    }
}

// === impl Queues ===

impl Queues {
    /// Admits acquire `ctx` for `key`, received at `now_ms` with wait `wait_ms`
    /// (0: try once). `older_elsewhere`: another worker of this Envoy has a waiter for
    /// `key` queued (from the backlog); a new request then queues behind it.
    pub(crate) fn admit(
        &mut self,
        key: &str,
        ctx: u32,
        now_ms: u64,
        wait_ms: u64,
        older_elsewhere: bool,
        max_queue: usize,
    ) -> Admission {
        let q = self.keys.entry(key.to_owned()).or_default();
        let idle = q.in_flight.is_none() && q.waiting.is_empty();
        let admission = if idle && !older_elsewhere {
            q.in_flight = Some(ctx);
            q.promoted = false;
            Admission::Forward
        } else if wait_ms == 0 {
            Admission::Contended
        } else if q.waiting.len() >= max_queue {
            Admission::QueueFull
        } else {
            let w = Waiter { ctx, received_ms: now_ms, wait_ms };
            q.waiting.push_back(w);
            self.deadlines.insert((w.deadline_ms(), ctx), key.to_owned());
            Admission::Queued
        };
        self.tidy(key);
        admission
    }

    /// Removes `ctx` from `key`'s queue: its request completed or its caller left.
    pub fn leave(&mut self, key: &str, ctx: u32) -> Left {
        let Some(q) = self.keys.get_mut(key) else {
            return Left::Absent;
        };
        let left = if q.in_flight == Some(ctx) {
            q.in_flight = None;
            Left::InFlight { queued: std::mem::take(&mut q.promoted) }
        } else if let Some(i) = q.waiting.iter().position(|w| w.ctx == ctx) {
            match q.waiting.remove(i) {
                Some(w) => {
                    self.deadlines.remove(&(w.deadline_ms(), w.ctx));
                    Left::Waiting(w)
                }
                None => Left::Absent,
            }
        } else {
            Left::Absent
        };
        self.tidy(key);
        left
    }

    /// Promotes `key`'s next waiter if its head slot is free. `is_first(ctx)` says
    /// whether that waiter is the oldest in the Envoy-wide backlog; if not, it stays
    /// queued. An expired waiter is always handed back (to be answered), whatever its
    /// place. Call repeatedly until `None`.
    pub(crate) fn promote(&mut self, key: &str, now_ms: u64, is_first: impl Fn(u32) -> bool) -> Option<Promotion> {
        let q = self.keys.get_mut(key)?;
        if q.in_flight.is_some() {
            return None;
        }
        let head = *q.waiting.front()?;
        let promotion = if now_ms >= head.deadline_ms() {
            Promotion::Expired(head)
        } else if is_first(head.ctx) {
            q.in_flight = Some(head.ctx);
            q.promoted = true;
            Promotion::Forward { waiter: head, budget_ms: head.deadline_ms() - now_ms }
        } else {
            return None;
        };
        q.waiting.pop_front();
        self.deadlines.remove(&(head.deadline_ms(), head.ctx));
        self.tidy(key);
        Some(promotion)
    }

    /// Removes and returns every waiter whose deadline is at or before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<(String, Waiter)> {
        let mut out = Vec::new();
        while let Some(entry) = self.deadlines.first_entry() {
            if entry.key().0 > now_ms {
                break;
            }
            let ((_, ctx), key) = entry.remove_entry();
            if let Some(q) = self.keys.get_mut(&key) {
                if let Some(i) = q.waiting.iter().position(|w| w.ctx == ctx) {
                    if let Some(w) = q.waiting.remove(i) {
                        out.push((key.clone(), w));
                    }
                }
            }
            self.tidy(&key);
        }
        out
    }

    /// Keys with at least one waiter, for the periodic promotion check.
    pub(crate) fn keys_with_waiters(&self) -> Vec<String> {
        self.keys.iter().filter(|(_, q)| !q.waiting.is_empty()).map(|(k, _)| k.clone()).collect()
    }

    /// Waiters queued for `key` (not counting the head in flight).
    pub fn depth(&self, key: &str) -> usize {
        self.keys.get(key).map_or(0, |q| q.waiting.len())
    }

    /// The head in flight for `key`, if any.
    pub fn in_flight(&self, key: &str) -> Option<u32> {
        self.keys.get(key).and_then(|q| q.in_flight)
    }

    /// Drops a key's entry once it is idle, so memory follows the live queues.
    fn tidy(&mut self, key: &str) {
        if self.keys.get(key).is_some_and(|q| q.in_flight.is_none() && q.waiting.is_empty()) {
            self.keys.remove(key);
        }
    }
}

#[cfg(test)]
mod tests;
