//! Transparent, request-scoped locks: the filter's half (`docs/TRANSPARENT.md`).
//!
//! A request on a transparent route with `x-lock-key` goes through its key's queue
//! like an acquire, marked with this VM's id and a fresh hold number; the arbiter
//! grants the key on this VM's session for the key's class and forwards the request
//! upstream with the token. The hold lives until the request ends:
//!
//! - **The request ends** (response complete, either side reset, local reply):
//!   `on_done` queues a release of its hold number and wakes the root context
//!   through this worker's wake-up queue; the root calls the arbiter
//!   (`POST /internal/v1/vm/release`). The call is made from the root because a
//!   callout from a finished request's context is cancelled with it. A failed call
//!   is retried with backoff ([`RELEASE_ATTEMPTS`] in all).
//! - **Renewal.** While this VM has sessions, the root renews all of them with one
//!   call (`POST /internal/v1/vm/keepalive`) every `renew_ms` the arbiter asks for
//!   (a third of the shortest class TTL), counted from each call's *send* time: a
//!   call that hangs (an arbiter paused, or waiting on a cluster that does not
//!   answer) does not hold the next one back. Each renewal is
//!   [`KEEPALIVE_FANOUT`] calls at once, through the shipped configs' own arbiter
//!   cluster (`lockmesh_arbiter_calls`, round robin): two consecutive picks on one
//!   worker go to two hosts, so a renewal reaches two arbiters (least-request could
//!   send both to a paused one while its connections were still opening;
//!   docs/TRANSPARENT.md, "When an arbiter hangs"). One healthy arbiter keeps the
//!   sessions renewed. At most [`MAX_KEEPALIVES_IN_FLIGHT`] are in
//!   flight, so a dead arbiter tier costs at most that many calls per timeout. Scheduling from the answer instead
//!   let one call that ran into its timeout (2 s by default) stretch the period past
//!   a 3 s TTL. A dead Envoy or a trapped VM stops renewing, so its holds expire
//!   within the class TTL.
//! - **Reconcile.** Every `reconcile_every_ms` the keepalive carries the hold numbers
//!   still open here and the next number; the arbiter releases this VM's holds
//!   numbered below it that are not open. A lost release is repaired within that
//!   period (plus one call).
//!
//! This module is the pure state; [`crate::worker`] and [`crate::root`] do the calls.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde_json::json;

/// Attempts for one release before it is left to the reconcile.
pub(crate) const RELEASE_ATTEMPTS: u32 = 5;
/// Renewal period before the arbiter named one, ms.
pub(crate) const DEFAULT_RENEW_MS: u64 = 1000;
/// Shortest renewal period accepted from the arbiter, ms.
pub(crate) const MIN_RENEW_MS: u64 = 200;
/// Most keepalive calls in flight at once (the module doc).
pub(crate) const MAX_KEEPALIVES_IN_FLIGHT: u32 = 4;
/// Calls per renewal (the module doc); each renews every session of the VM.
pub(crate) const KEEPALIVE_FANOUT: u32 = 2;
/// The arbiter's VM keepalive route.
pub(crate) const KEEPALIVE_PATH: &str = "/internal/v1/vm/keepalive";
/// The arbiter's transparent release route.
pub(crate) const RELEASE_PATH: &str = "/internal/v1/vm/release";

/// A release to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// The raw key (sent to the arbiter in the body, never logged).
    pub key: String,
    /// The hold number.
    pub hold: u64,
    /// Attempts made so far.
    pub attempts: u32,
    /// Not before this time, ms.
    pub not_before_ms: u64,
}

/// A call in flight, by callout token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// A keepalive (with a reconcile when `reconcile`).
    Keepalive {
        /// Whether it carried the open holds.
        reconcile: bool,
    },
    Release(Release),
}

/// One VM's transparent-mode state.
#[derive(Debug)]
pub struct Holds {
    vm: String,
    next: u64,
    open: BTreeSet<u64>,
    pending: VecDeque<Release>,
    calls: BTreeMap<u32, Call>,
    /// When the next keepalive is due, ms; `None` while the VM has no sessions.
    keepalive_due_ms: Option<u64>,
    keepalives_in_flight: u32,
    renew_ms: u64,
    last_reconcile_ms: u64,
}

/// A 128-bit VM id in hex, from the host's randomness (WASI `random_get` seeds
/// `RandomState`) mixed with the time and a caller-given tag.
pub(crate) fn new_vm_id(now_ns: u128, tag: u32) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut out = String::with_capacity(32);
    for i in 0u8..2 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(now_ns);
        h.write_u32(tag);
        h.write_u8(i);
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

// === impl Holds ===

impl Holds {
    /// The state of VM `vm`.
    pub fn new(vm: String) -> Self {
        Self {
            vm,
            next: 0,
            open: BTreeSet::new(),
            pending: VecDeque::new(),
            calls: BTreeMap::new(),
            keepalive_due_ms: None,
            keepalives_in_flight: 0,
            renew_ms: DEFAULT_RENEW_MS,
            last_reconcile_ms: 0,
        }
    }

    /// The VM id.
    pub fn vm(&self) -> &str {
        &self.vm
    }

    /// A new hold number for a request being admitted; open until [`Holds::end`].
    /// Renewal starts with the first one.
    pub fn open(&mut self, now_ms: u64) -> u64 {
        let n = self.next;
        self.next += 1;
        self.open.insert(n);
        if self.keepalive_due_ms.is_none() {
            self.keepalive_due_ms = Some(now_ms + self.renew_ms);
        }
        n
    }

    /// Hold numbers open now.
    pub fn open_count(&self) -> usize {
        self.open.len()
    }

    /// The request of hold `n` ended; `forwarded` says whether it reached the
    /// arbiter (only then can it hold anything). Returns whether a release was queued.
    pub fn end(&mut self, key: &str, n: u64, forwarded: bool, now_ms: u64) -> bool {
        self.open.remove(&n);
        if forwarded {
            self.pending.push_back(Release { key: key.to_owned(), hold: n, attempts: 0, not_before_ms: now_ms });
        }
        forwarded
    }

    /// Releases due now, removed from the pending list.
    pub(crate) fn due_releases(&mut self, now_ms: u64) -> Vec<Release> {
        let (due, later): (Vec<_>, Vec<_>) = self.pending.drain(..).partition(|r| r.not_before_ms <= now_ms);
        self.pending = later.into();
        due
    }

    /// The body of a release call.
    pub fn release_body(&self, r: &Release) -> Vec<u8> {
        json!({ "vm": self.vm, "key": r.key, "hold": r.hold }).to_string().into_bytes()
    }

    /// Whether a keepalive is due, and with a reconcile (the caller sends
    /// [`Holds::keepalive_calls`] calls of it).
    pub(crate) fn keepalive_due(&self, now_ms: u64, reconcile_every_ms: u64) -> Option<bool> {
        let due = self.keepalive_due_ms?;
        if self.keepalives_in_flight >= MAX_KEEPALIVES_IN_FLIGHT || now_ms < due {
            return None;
        }
        Some(now_ms.saturating_sub(self.last_reconcile_ms) >= reconcile_every_ms)
    }

    /// How many calls the due keepalive is: [`KEEPALIVE_FANOUT`], fewer if the
    /// in-flight bound leaves less room.
    pub(crate) fn keepalive_calls(&self) -> u32 {
        KEEPALIVE_FANOUT.min(MAX_KEEPALIVES_IN_FLIGHT.saturating_sub(self.keepalives_in_flight))
    }

    /// The body of a keepalive call.
    pub fn keepalive_body(&self, reconcile: bool) -> Vec<u8> {
        let v = if reconcile {
            json!({ "vm": self.vm, "open": self.open.iter().collect::<Vec<_>>(), "next": self.next })
        } else {
            json!({ "vm": self.vm })
        };
        v.to_string().into_bytes()
    }

    /// Records a call made with callout `token`.
    pub fn sent(&mut self, token: u32, call: Call, now_ms: u64) {
        if let Call::Keepalive { reconcile } = &call {
            self.keepalives_in_flight += 1;
            // The next one is due a period after this one left, answered or not.
            self.keepalive_due_ms = Some(now_ms + self.renew_ms);
            if *reconcile {
                self.last_reconcile_ms = now_ms;
            }
        }
        self.calls.insert(token, call);
    }

    /// A call could not even be made: a release is retried later.
    pub(crate) fn not_sent(&mut self, call: Call, now_ms: u64) {
        self.failed(call, now_ms);
    }

    /// The answer to callout `token` (`status` 0 when the call failed without one).
    /// Returns the call, so the caller can count it.
    pub fn answered(&mut self, token: u32, status: u32, body: &[u8], now_ms: u64) -> Option<Call> {
        let call = self.calls.remove(&token)?;
        match (&call, status) {
            (Call::Keepalive { .. }, 200) => {
                self.keepalives_in_flight = self.keepalives_in_flight.saturating_sub(1);
                let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
                let sessions = v.get("sessions").and_then(serde_json::Value::as_u64).unwrap_or(0);
                if let Some(ms) = v.get("renew_ms").and_then(serde_json::Value::as_u64) {
                    self.renew_ms = ms.max(MIN_RENEW_MS);
                }
                // No sessions and nothing open: stop renewing until the next hold.
                // Otherwise the next call stays due a period after the last send
                // (sooner if the arbiter asked for a shorter period).
                let next = now_ms + self.renew_ms;
                self.keepalive_due_ms = if sessions == 0 && self.open.is_empty() {
                    None
                } else {
                    Some(self.keepalive_due_ms.map_or(next, |d| d.min(next)))
                };
            }
            (Call::Release(_), 200) => {}
            _ => self.failed(call.clone(), now_ms),
        }
        Some(call)
    }

    fn failed(&mut self, call: Call, now_ms: u64) {
        match call {
            Call::Keepalive { .. } => {
                self.keepalives_in_flight = self.keepalives_in_flight.saturating_sub(1);
                // Retry soon: a session must not lapse for one lost call.
                let retry = now_ms + (self.renew_ms / 2).max(MIN_RENEW_MS);
                self.keepalive_due_ms = Some(self.keepalive_due_ms.map_or(retry, |d| d.min(retry)));
            }
            Call::Release(mut r) => {
                r.attempts += 1;
                if r.attempts < RELEASE_ATTEMPTS {
                    r.not_before_ms = now_ms + 100 * (1 << r.attempts.min(6));
                    self.pending.push_back(r);
                }
                // Past the attempts: the next reconcile releases it.
            }
        }
    }

    /// Whether anything waits to be sent later (the tick must look again).
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests;
