//! Prometheus metrics. Labels are namespace (only a namespace the registry names;
//! anything else is `other`), class, tier, and bounded enums (route, code, outcome,
//! reason, state); never a key, token, session or identity (ADR-22). The cluster
//! label is added by the scrape (ServiceMonitor relabelling), not here.

use std::{
    collections::BTreeMap,
    fmt::Write,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex,
    },
};

pub use lockmesh_telemetry::labels::{
    labels_of_raw, lock_labels, tier_label, Histogram, LockLabels, HOLD_BUCKETS, LATENCY_BUCKETS,
};

/// The arbiter's view of etcd, updated by the seal checker every second.
#[derive(Debug, Default)]
pub struct EtcdHealth {
    reachable: AtomicBool,
    failing_since_ms: AtomicU64,
    failures: AtomicU64,
}

/// etcd reachability as the seal checker last saw it (a process-wide fact).
pub static ETCD: EtcdHealth =
    EtcdHealth { reachable: AtomicBool::new(false), failing_since_ms: AtomicU64::new(0), failures: AtomicU64::new(0) };

// === impl EtcdHealth ===

impl EtcdHealth {
    /// Records one seal check's outcome.
    pub fn observe(&self, ok: bool) {
        self.reachable.store(ok, Ordering::Relaxed);
        if ok {
            self.failing_since_ms.store(0, Ordering::Relaxed);
        } else {
            self.failures.fetch_add(1, Ordering::Relaxed);
            let _ =
                self.failing_since_ms.compare_exchange(0, crate::lock::now_ms(), Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// True when the last seal check read etcd linearizably.
    pub fn reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// How long linearizable reads have been failing at `now_ms`, ms (0 while they succeed).
    pub fn failing_for_ms(&self, now_ms: u64) -> u64 {
        let since = self.failing_since_ms.load(Ordering::Relaxed);
        if since == 0 {
            0
        } else {
            now_ms.saturating_sub(since)
        }
    }

    /// The exposition lines.
    pub fn render(&self, s: &mut String) {
        s.push_str("# HELP lockmesh_arbiter_etcd_reachable 1 when the last seal check read the epoch record linearizably (etcd has quorum and answers).\n");
        s.push_str("# TYPE lockmesh_arbiter_etcd_reachable gauge\n");
        let _ = writeln!(s, "lockmesh_arbiter_etcd_reachable {}", u8::from(self.reachable.load(Ordering::Relaxed)));
        s.push_str("# HELP lockmesh_arbiter_quorum_lost_seconds How long linearizable reads have been failing (0 while they succeed).\n");
        s.push_str("# TYPE lockmesh_arbiter_quorum_lost_seconds gauge\n");
        let since = self.failing_since_ms.load(Ordering::Relaxed);
        let age = if since == 0 { 0.0 } else { crate::lock::now_ms().saturating_sub(since) as f64 / 1000.0 };
        let _ = writeln!(s, "lockmesh_arbiter_quorum_lost_seconds {age:.3}");
        s.push_str("# HELP lockmesh_arbiter_etcd_check_failures_total Seal checks that could not read etcd.\n");
        s.push_str("# TYPE lockmesh_arbiter_etcd_check_failures_total counter\n");
        let _ = writeln!(s, "lockmesh_arbiter_etcd_check_failures_total {}", self.failures.load(Ordering::Relaxed));
    }
}

/// The route label of a request path: a closed set.
pub fn route_label(method: &str, path: &str) -> &'static str {
    match (method, path) {
        ("POST", "/v1/locks/acquire") => "acquire",
        ("POST", "/v1/locks/release") => "release",
        ("GET", "/v1/locks") => "inspect",
        ("POST", "/v1/sessions") => "session_open",
        ("POST", "/v1/sessions/keepalive") => "keepalive",
        ("POST", "/v1/sessions/close") => "session_close",
        ("GET", "/v1/sessions/holds") => "session_holds",
        _ => "other",
    }
}

/// Counters.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    abandoned: Mutex<u64>,
    acquires: Mutex<BTreeMap<(LockLabels, &'static str), u64>>,
    grant_latency: Mutex<BTreeMap<LockLabels, Histogram>>,
    renewal_failures: Mutex<BTreeMap<&'static str, u64>>,
}

/// The outcome label of an acquire: a closed set.
pub fn outcome_label(r: &Result<crate::lock::mutex::Grant, crate::lock::LockError>) -> &'static str {
    use crate::lock::LockError as E;
    match r {
        Ok(_) => "granted",
        Err(E::Contended(lockmesh_core::Reason::KeyGated)) => "key_gated",
        Err(E::Contended(lockmesh_core::Reason::LockContended)) => "lock_contended",
        Err(E::Leaked) => "leaked",
        Err(E::SessionExpired | E::SessionClassMismatch { .. }) => "session",
        Err(E::Sealed(_)) => "sealed",
        Err(E::Unavailable(_) | E::Moved) => "unavailable",
        Err(E::Cancelled) => "cancelled",
        Err(E::Draining(_)) => "draining",
        Err(E::SpoolFull(_)) => "spool_full",
        Err(E::NotHolder | E::Internal(_)) => "error",
    }
}

impl Metrics {
    /// Counts one acquire by outcome, and its latency when granted.
    pub fn acquire(&self, labels: LockLabels, outcome: &'static str, seconds: f64) {
        if outcome == "granted" {
            if let Ok(mut h) = self.grant_latency.lock() {
                h.entry(labels.clone()).or_insert_with(|| Histogram::new(LATENCY_BUCKETS)).observe(seconds);
            }
        }
        if let Ok(mut m) = self.acquires.lock() {
            *m.entry((labels, outcome)).or_default() += 1;
        }
    }

    /// Counts a failed session renewal: `expired` (the session is gone) or
    /// `unavailable` (etcd did not answer).
    pub fn renewal_failure(&self, e: &crate::lock::LockError) {
        let reason = if matches!(e, crate::lock::LockError::SessionExpired) { "expired" } else { "unavailable" };
        if let Ok(mut m) = self.renewal_failures.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    fn render_locks(&self, s: &mut String) {
        s.push_str("# HELP lockmesh_arbiter_acquires_total Acquires answered, by outcome (granted, key_gated: the key is at its limit, lock_contended: lost a race, draining, sealed, ...).\n");
        s.push_str("# TYPE lockmesh_arbiter_acquires_total counter\n");
        if let Ok(m) = self.acquires.lock() {
            for ((l, outcome), n) in m.iter() {
                let _ = writeln!(s, "lockmesh_arbiter_acquires_total{{{},outcome=\"{outcome}\"}} {n}", l.render());
            }
        }
        s.push_str("# HELP lockmesh_arbiter_grant_latency_seconds Time from receiving an acquire to its grant, waits included.\n");
        s.push_str("# TYPE lockmesh_arbiter_grant_latency_seconds histogram\n");
        if let Ok(m) = self.grant_latency.lock() {
            for (l, h) in m.iter() {
                h.render(s, "lockmesh_arbiter_grant_latency_seconds", &l.render());
            }
        }
        s.push_str("# HELP lockmesh_arbiter_renewal_failures_total Session keepalives refused (expired) or failed (unavailable).\n");
        s.push_str("# TYPE lockmesh_arbiter_renewal_failures_total counter\n");
        if let Ok(m) = self.renewal_failures.lock() {
            for reason in ["expired", "unavailable"] {
                let _ = writeln!(
                    s,
                    "lockmesh_arbiter_renewal_failures_total{{reason=\"{reason}\"}} {}",
                    m.get(reason).copied().unwrap_or(0)
                );
            }
        }
        ETCD.render(s);
    }

    /// Counts one answered request.
    pub fn request(&self, route: &'static str, code: &'static str) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((route, code)).or_default() += 1;
        }
    }

    /// Counts a grant undone because its caller left.
    pub fn abandoned(&self) {
        if let Ok(mut m) = self.abandoned.lock() {
            *m += 1;
        }
    }

    /// The text exposition.
    pub fn render(&self, waiting_keys: usize, seal: Option<(crate::lock::seal::SealReason, u64)>) -> String {
        let mut s = String::new();
        s.push_str("# HELP lockmesh_arbiter_requests_total API requests answered, by route and result code.\n");
        s.push_str("# TYPE lockmesh_arbiter_requests_total counter\n");
        if let Ok(m) = self.requests.lock() {
            for ((route, code), n) in m.iter() {
                let _ = writeln!(s, "lockmesh_arbiter_requests_total{{route=\"{route}\",code=\"{code}\"}} {n}");
            }
        }
        s.push_str(
            "# HELP lockmesh_arbiter_abandoned_grants_total Grants released at once because the caller had gone.\n",
        );
        s.push_str("# TYPE lockmesh_arbiter_abandoned_grants_total counter\n");
        let _ =
            writeln!(s, "lockmesh_arbiter_abandoned_grants_total {}", self.abandoned.lock().map(|g| *g).unwrap_or(0));
        s.push_str("# HELP lockmesh_arbiter_waiting_keys Keys with at least one waiter queued on this arbiter.\n");
        s.push_str("# TYPE lockmesh_arbiter_waiting_keys gauge\n");
        let _ = writeln!(s, "lockmesh_arbiter_waiting_keys {waiting_keys}");
        s.push_str("# HELP lockmesh_arbiter_sealed 1 while the arbiter is sealed for this reason (restore safety).\n");
        s.push_str("# TYPE lockmesh_arbiter_sealed gauge\n");
        for r in crate::lock::seal::SealReason::ALL {
            let v = u8::from(seal.is_some_and(|(sr, _)| sr == r));
            let _ = writeln!(s, "lockmesh_arbiter_sealed{{reason=\"{}\"}} {v}", r.as_str());
        }
        s.push_str(
            "# HELP lockmesh_arbiter_sealed_since_seconds Unix time the current seal was declared (0 when unsealed).\n",
        );
        s.push_str("# TYPE lockmesh_arbiter_sealed_since_seconds gauge\n");
        let _ = writeln!(s, "lockmesh_arbiter_sealed_since_seconds {}", seal.map_or(0, |(_, ms)| ms / 1000));
        crate::lock::wait::HANDOFFS.render(&mut s);
        crate::failopen::STATS.render(&mut s);
        self.render_locks(&mut s);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_labels_come_from_the_registry() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        h.observe(0.5);
        h.observe(1.5);
        h.observe(9.0);
        let mut s = String::new();
        h.render(&mut s, "x", "class=\"a\"");
        assert!(s.contains("x_bucket{class=\"a\",le=\"1\"} 1\n"));
        assert!(s.contains("x_bucket{class=\"a\",le=\"2\"} 2\n"));
        assert!(s.contains("x_bucket{class=\"a\",le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_count{class=\"a\"} 3\n"));
        let reg = crate::registry::parse(
            "classes:\n  - name: pay\n    prefixes: [payments]\n    ttl_s: 60\n    enforcement: advisory\n    risk_owner: t\n    waiver_expiry: \"2099-12-31\"\n  - name: d\n    default: true\n    ttl_s: 60\n    enforcement: advisory\n    risk_owner: t\n    waiver_expiry: \"2099-12-31\"\n",
        )
        .unwrap();
        let l = labels_of_raw(&reg, "payments/order-1");
        assert_eq!((l.namespace.as_str(), l.class.as_str()), ("payments", "pay"));
        // A caller-chosen namespace never becomes a label value.
        let l = labels_of_raw(&reg, "attacker-chosen-ns/x");
        assert_eq!((l.namespace.as_str(), l.class.as_str()), ("other", "d"));
    }
}
