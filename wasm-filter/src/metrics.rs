//! The filter's metrics (ADR-22): labels are the namespace (from the configured
//! `namespaces`, else `other`) and the outcome, never a key, token or identity.
//!
//! Proxy-Wasm metrics have names only, so labels are encoded in the name and the
//! bootstrap's `stats_config.stats_tags` turns them back into tags (Prometheus:
//! `lockmesh_filter_requests{ns="payments",outcome="denied"}`):
//!
//! | Name | Type | Meaning |
//! |---|---|---|
//! | `lockmesh_filter_requests.ns.<ns>.outcome.<outcome>` | counter | requests by what the filter did ([`Outcome`]) |
//! | `lockmesh_filter_queue_depth.ns.<ns>` | gauge | acquire requests queued in the filter (summed over workers) |
//! | `lockmesh_filter_queue_wait_ms.ns.<ns>` | histogram | time a waiter spent queued, ms, on leaving the queue |
//! | `lockmesh_filter_transparent_releases.result.<ok\|failed>` | counter | release calls for transparent holds |
//!
//! Metrics are defined lazily, per name, so only label combinations that occur exist;
//! names are bounded by `namespaces` x outcomes.

use std::collections::BTreeMap;

use lockmesh_core::Code;
use proxy_wasm::{hostcalls, types::MetricType};

/// What the filter did with a request (the `outcome` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Passed on to the arbiter (at once, or after queueing).
    Forwarded,
    /// `400`: a malformed, duplicated or missing lock header.
    BadRequest,
    /// `403`: no grant allows it.
    Denied,
    /// `401`: no verified SPIFFE ID.
    Unauthenticated,
    /// `404`: unknown route.
    NotFound,
    /// `429`: the key's queue on this worker is full.
    QueueFull,
    /// `409` from the filter: a try-once behind others, or a waiter whose deadline
    /// passed while queued.
    ContendedLocal,
    /// `429` from a Tier-1 local limit, which is approximate (per Envoy).
    LimitedApprox,
    /// A queued waiter whose caller went away.
    Cancelled,
    /// `500`: the filter could not do its job (a host call failed).
    Internal,
    /// `428`: a transparent route's request without `x-lock-key`.
    LockRequired,
    /// A transparent route's request without `x-lock-key`, let through unlocked.
    Unlocked,
}

/// Number of [`Outcome`]s.
const OUTCOMES: usize = 12;

/// Lazily defined metric ids, by name; request counters also by namespace and
/// outcome, so counting a request allocates nothing once its counter exists.
#[derive(Debug, Default)]
pub struct Metrics {
    ids: BTreeMap<String, u32>,
    requests: BTreeMap<String, [Option<u32>; OUTCOMES]>,
}

// === impl Outcome ===

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::BadRequest => "bad_request",
            Outcome::Denied => "denied",
            Outcome::Unauthenticated => "unauthenticated",
            Outcome::NotFound => "not_found",
            Outcome::QueueFull => "queue_full",
            Outcome::ContendedLocal => "contended_local",
            Outcome::LimitedApprox => "limited_approx",
            Outcome::Cancelled => "cancelled",
            Outcome::Internal => "internal",
            Outcome::LockRequired => "lock_required",
            Outcome::Unlocked => "unlocked",
        }
    }

    /// The outcome of a refusal decided by [`crate::decide`].
    pub(crate) fn of_code(code: Code) -> Self {
        match code {
            Code::Unauthenticated => Outcome::Unauthenticated,
            Code::Denied => Outcome::Denied,
            Code::NotFound => Outcome::NotFound,
            Code::QueueFull => Outcome::QueueFull,
            Code::Contended => Outcome::ContendedLocal,
            Code::Internal => Outcome::Internal,
            Code::LockRequired => Outcome::LockRequired,
            _ => Outcome::BadRequest,
        }
    }
}

/// The request counter's name.
pub(crate) fn requests_name(ns: &str, outcome: Outcome) -> String {
    format!("lockmesh_filter_requests.ns.{ns}.outcome.{}", outcome.as_str())
}

/// The queue depth gauge's name.
pub(crate) fn queue_depth_name(ns: &str) -> String {
    format!("lockmesh_filter_queue_depth.ns.{ns}")
}

/// The queue wait histogram's name.
pub(crate) fn queue_wait_name(ns: &str) -> String {
    format!("lockmesh_filter_queue_wait_ms.ns.{ns}")
}

// === impl Metrics ===

impl Metrics {
    fn id(&mut self, kind: MetricType, name: String) -> Option<u32> {
        if let Some(id) = self.ids.get(&name) {
            return Some(*id);
        }
        let id = hostcalls::define_metric(kind, &name).ok()?;
        self.ids.insert(name, id);
        Some(id)
    }

    /// Counts one request with `outcome`.
    pub fn request(&mut self, ns: &str, outcome: Outcome) {
        let slot = outcome as usize;
        let cached = self.requests.get(ns).and_then(|ids| ids.get(slot).copied().flatten());
        let id = match cached {
            Some(id) => Some(id),
            None => {
                let id = self.id(MetricType::Counter, requests_name(ns, outcome));
                if let Some(id) = id {
                    let ids = self.requests.entry(ns.to_owned()).or_insert([None; OUTCOMES]);
                    if let Some(s) = ids.get_mut(slot) {
                        *s = Some(id);
                    }
                }
                id
            }
        };
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    /// Moves the queue depth gauge by `delta`.
    pub(crate) fn queue_depth(&mut self, ns: &str, delta: i64) {
        if let Some(id) = self.id(MetricType::Gauge, queue_depth_name(ns)) {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    /// Counts a transparent hold's release call by result.
    pub fn release(&mut self, ok: bool) {
        let name = format!("lockmesh_filter_transparent_releases.result.{}", if ok { "ok" } else { "failed" });
        if let Some(id) = self.id(MetricType::Counter, name) {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    /// Records a waiter's time in the queue.
    pub(crate) fn queue_wait(&mut self, ns: &str, ms: u64) {
        if let Some(id) = self.id(MetricType::Histogram, queue_wait_name(ns)) {
            let _ = hostcalls::record_metric(id, ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_only_namespace_and_outcome() {
        assert_eq!(requests_name("payments", Outcome::Denied), "lockmesh_filter_requests.ns.payments.outcome.denied");
        assert_eq!(queue_depth_name("other"), "lockmesh_filter_queue_depth.ns.other");
        assert_eq!(Outcome::of_code(Code::ClassMismatch), Outcome::BadRequest);
        assert_eq!(Outcome::Unlocked as usize, OUTCOMES - 1, "OUTCOMES counts every outcome");
    }
}
