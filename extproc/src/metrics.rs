//! Prometheus metrics (`/metrics` on the admin port), encoded by prometheus-client
//! in the Prometheus text format 0.0.4 ([`CONTENT_TYPE`]). Labels are namespace
//! (only a namespace the registry names; anything else is `other`), class, tier, and
//! bounded enums (route, code, outcome, reason, state); never a key, token, session
//! or identity (ADR-22). The cluster label is added by the scrape (ServiceMonitor
//! relabelling), not here.
//!
//! One [`Registry`] holds the arbiter's families, the fail-open ones
//! (`lockmesh_lock::failopen::STATS`), the class ones (`crate::registry`) and
//! collectors read at scrape time: the hand-off counters
//! (`lockmesh_lock::wait::HANDOFFS`), etcd's health and the seal checks' time
//! ([`ETCD`]), the etcd steps of lock cycles (`lockmesh_lock::steps`), and the holds and
//! waits by namespace and class ([`WaitCollector`]: the oldest open hold, from the
//! quota ledgers; gated waiters, wake-ups per grant and pickup latency, from the
//! waiters' books of `lockmesh_lock::wait`). Values that exist only at scrape time
//! (waiting keys, seal state, class gauges) are set by [`Metrics::encode`] just
//! before it encodes.

mod shadow;

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, LazyLock, Mutex, RwLock,
    },
    time::Duration,
};

use lockmesh_telemetry::labels::Described;
use prometheus_client::{
    collector::Collector,
    encoding::{prometheus_text, DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::Histogram,
        MetricType,
    },
    registry::Registry,
};

pub use lockmesh_telemetry::labels::{
    labels_of_raw, lock_labels, tier_label, LockLabels, HOLD_BUCKETS, LATENCY_BUCKETS,
};

/// The `Content-Type` of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The arbiter's view of etcd, updated by the seal checker every second.
#[derive(Debug, Default)]
pub struct EtcdHealth {
    reachable: AtomicBool,
    failing_since_ms: AtomicU64,
    failures: AtomicU64,
    /// Seal checks, and their total time in µs (what `ETCD_CHECK` counts; its
    /// count and sum are not readable outside prometheus-client's tests).
    checks: AtomicU64,
    sum_us: AtomicU64,
    /// The slowest check since [`EtcdHealth::take_max_us`] last ran, µs.
    max_us: AtomicU64,
}

/// etcd reachability as the seal checker last saw it (a process-wide fact).
pub static ETCD: EtcdHealth = EtcdHealth {
    reachable: AtomicBool::new(false),
    failing_since_ms: AtomicU64::new(0),
    failures: AtomicU64::new(0),
    checks: AtomicU64::new(0),
    sum_us: AtomicU64::new(0),
    max_us: AtomicU64::new(0),
};

/// How long each seal check took (`lockmesh_arbiter_etcd_check_seconds`).
static ETCD_CHECK: LazyLock<Histogram> = LazyLock::new(latency_histogram);

/// The seal checks so far: how many, how many failed, their total time (µs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct EtcdChecks {
    pub checks: u64,
    pub failures: u64,
    pub sum_us: u64,
}

// === impl EtcdHealth ===

impl EtcdHealth {
    /// Records one seal check's outcome and how long it took.
    pub fn observe(&self, ok: bool, took: Duration) {
        ETCD_CHECK.observe(took.as_secs_f64());
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.checks.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.max_us.fetch_max(us, Ordering::Relaxed);
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

    /// The seal checks so far (the history's etcd series, `console::history`).
    pub(crate) fn checks(&self) -> EtcdChecks {
        EtcdChecks {
            checks: self.checks.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            sum_us: self.sum_us.load(Ordering::Relaxed),
        }
    }

    /// The slowest check since the last call, µs (0 without one), and starts over.
    pub(crate) fn take_max_us(&self) -> u64 {
        self.max_us.swap(0, Ordering::Relaxed)
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
}

/// Encodes [`ETCD`] at scrape time: `lockmesh_arbiter_etcd_reachable`,
/// `lockmesh_arbiter_quorum_lost_seconds`, `lockmesh_arbiter_etcd_check_failures_total`
/// and `lockmesh_arbiter_etcd_check_seconds`.
#[derive(Debug)]
struct EtcdCollector;

impl Collector for EtcdCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        // A collector's help is written as given (the registry's own metrics get a `.` appended).
        ConstGauge::new(i64::from(ETCD.reachable())).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_etcd_reachable",
            "1 when the last seal check read the epoch record linearizably (etcd has quorum and answers).",
            None,
            MetricType::Gauge,
        )?)?;
        let lost_s = ETCD.failing_for_ms(crate::lock::now_ms()) as f64 / 1000.0;
        ConstGauge::new(lost_s).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_quorum_lost_seconds",
            "How long linearizable reads have been failing (0 while they succeed).",
            None,
            MetricType::Gauge,
        )?)?;
        ConstCounter::new(ETCD.failures.load(Ordering::Relaxed)).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_etcd_check_failures",
            "Seal checks that could not read etcd.",
            None,
            MetricType::Counter,
        )?)?;
        // The etcd steps of lock cycles (`lockmesh_lock::steps`): a closed label set.
        let steps = crate::lock::steps::STEPS.all();
        {
            let mut family = encoder.encode_descriptor(
                "lockmesh_arbiter_etcd_step_seconds",
                "Total time of this arbiter's etcd calls by lock-cycle step (grant_txn, handoff_txn, release_txn, held_read, raft_check), from the call to etcd's answer; divided by lockmesh_arbiter_etcd_steps_total, the mean latency of the step.",
                None,
                MetricType::Counter,
            )?;
            for (step, _, secs) in &steps {
                ConstCounter::new(*secs).encode(family.encode_family(&[("step", step.label())])?)?;
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "lockmesh_arbiter_etcd_steps",
                "This arbiter's etcd calls by lock-cycle step (see lockmesh_arbiter_etcd_step_seconds_total).",
                None,
                MetricType::Counter,
            )?;
            for (step, n, _) in &steps {
                ConstCounter::new(*n).encode(family.encode_family(&[("step", step.label())])?)?;
            }
        }
        // Grants and releases committed in groups (`lockmesh_lock` `engine::group`).
        let g = &crate::lock::GROUPS;
        ConstCounter::new(g.groups()).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_group_commits",
            "Groups of grants and releases this arbiter sent to etcd as one transaction of nested transactions (etcd.max_group).",
            None,
            MetricType::Counter,
        )?)?;
        ConstCounter::new(g.members()).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_group_members",
            "Grants and releases the groups carried; divided by lockmesh_arbiter_group_commits_total, the mean group size.",
            None,
            MetricType::Counter,
        )?)?;
        ConstCounter::new(g.queued_seconds()).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_group_queued_seconds",
            "Total time grants and releases waited for their group to be sent (behind the group in flight).",
            None,
            MetricType::Counter,
        )?)?;
        ConstGauge::new(i64::try_from(g.largest()).unwrap_or(i64::MAX)).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_group_largest",
            "The largest group sent since this arbiter started.",
            None,
            MetricType::Gauge,
        )?)?;
        {
            let mut family = encoder.encode_descriptor(
                "lockmesh_arbiter_group_refusals",
                "Groups that did not run as one, by cause (moved: a new epoch or a restored store; duplicate_key, lease_not_found, too_many_ops, too_large, other: refused by etcd before applying); each member was then sent alone. Any but moved is a defect to report.",
                None,
                MetricType::Counter,
            )?;
            for cause in crate::lock::GroupRefusal::ALL {
                ConstCounter::new(g.refused(cause)).encode(family.encode_family(&[("cause", cause.label())])?)?;
            }
        }
        ConstCounter::new(crate::lock::policy_watch::EVENTS.load(Ordering::Relaxed)).encode(
            encoder.encode_descriptor(
                "lockmesh_arbiter_policy_watch_events",
                "Changes of the class policies or the class map this arbiter's policy watch saw; each dropped its policy cache (lockmesh_lock::policy_watch).",
                None,
                MetricType::Counter,
            )?,
        )?;
        ConstGauge::new(crate::lock::policy_watch::OPEN.load(Ordering::Relaxed)).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_policy_watches_open",
            "Policy watches open now (one per etcd cluster in use): while one is open, the next head of a key held by another caller takes the limit from the cache instead of reading it.",
            None,
            MetricType::Gauge,
        )?)?;
        ETCD_CHECK.encode(encoder.encode_descriptor(
            "lockmesh_arbiter_etcd_check_seconds",
            "Time of each seal check (a linearizable read of the epoch record, once a second; failed ones included): etcd's latency as this arbiter sees it (per arbiter).",
            None,
            MetricType::Histogram,
        )?)
    }
}

/// Encodes `lockmesh_lock::vm::RENEWAL_FAILURES` at scrape time as
/// `lockmesh_arbiter_vm_renewal_failures_total{etcd_cluster}`, and
/// `lockmesh_lock::vm::JEOPARDY` as `lockmesh_arbiter_vm_sessions_in_jeopardy{etcd_cluster}`:
/// one series per etcd cluster of this arbiter's config (a bounded set), each from 0.
#[derive(Debug)]
struct VmRenewalCollector;

impl Collector for VmRenewalCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let clusters = crate::lock::vm::RENEWAL_FAILURES.snapshot();
        {
            let mut family = encoder.encode_descriptor(
                "lockmesh_arbiter_vm_renewal_failures",
                "Transparent-mode VM session renewals that failed, by etcd cluster (a failing cluster does not stop the others' renewals).",
                None,
                MetricType::Counter,
            )?;
            for (cluster, n) in &clusters {
                ConstCounter::new(*n).encode(family.encode_family(&[("etcd_cluster", cluster.as_str())])?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "lockmesh_arbiter_vm_sessions_in_jeopardy",
            "Transparent-mode VM sessions whose last renewal by this arbiter failed and whose TTL has not run out since its last renewal here, by etcd cluster (0 again on recovery or expiry).",
            None,
            MetricType::Gauge,
        )?;
        let now = std::time::Instant::now();
        for (cluster, _) in &clusters {
            let n = crate::lock::vm::JEOPARDY.count(cluster, now);
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
                .encode(family.encode_family(&[("etcd_cluster", cluster.as_str())])?)?;
        }
        Ok(())
    }
}

/// Encodes the holds and waits by namespace and class at scrape time (ADR-033):
/// `lockmesh_arbiter_oldest_hold_seconds` and `lockmesh_arbiter_open_holds`
/// (fleet-wide: every cluster's ledger, which follows every arbiter's holds),
/// `lockmesh_arbiter_gated_waiters` and `lockmesh_arbiter_oldest_gated_wait_seconds`
/// (this arbiter's waiters), `lockmesh_arbiter_wakeups_per_grant` and
/// `lockmesh_arbiter_pickup_latency_seconds` (grants here after a wait). Labels are
/// `namespace` (`other` unless the registry names it) and `class`; every pair the
/// registry's prefixes declare is there from the start, and a pair that had a
/// hold or a waiter stays (at 0) once it has none.
struct WaitCollector(Arc<crate::lock::Runtime>);

impl std::fmt::Debug for WaitCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WaitCollector")
    }
}

/// The label pairs the oldest-hold gauge has shown: it keeps them at 0 afterwards
/// (bounded: namespace and class labels are the registry's or `other`).
static HOLD_PAIRS: Mutex<std::collections::BTreeSet<(String, String)>> = Mutex::new(std::collections::BTreeSet::new());

/// The open holds and the oldest hold's age (ms) by (namespace, class) label
/// pair, over every cluster's quota ledger now: every pair the registry declares
/// or that had a hold since this process started (at 0 without one).
pub(crate) fn hold_rows(rt: &crate::lock::Runtime) -> std::collections::BTreeMap<(String, String), (u64, u64)> {
    let holds = rt.quotas().oldest_holds(crate::lock::now_ms());
    let mut seen = HOLD_PAIRS.lock().unwrap_or_else(|p| p.into_inner());
    let mut rows: std::collections::BTreeMap<(String, String), (u64, u64)> =
        seen.iter().map(|p| (p.clone(), (0, 0))).collect();
    for h in holds {
        seen.insert((h.namespace.clone(), h.class.clone()));
        rows.insert((h.namespace, h.class), (h.holds, h.age_ms));
    }
    rows
}

impl Collector for WaitCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let pair = |ns: &'_ str, class: &'_ str| -> [(&'static str, String); 2] {
            [("namespace", ns.to_owned()), ("class", class.to_owned())]
        };
        {
            // (namespace, class) -> (open holds, oldest age ms).
            let rows = hold_rows(&self.0);
            let mut family = encoder.encode_descriptor(
                "lockmesh_arbiter_oldest_hold_seconds",
                "Age of the oldest open hold by namespace and class, over every etcd cluster (fleet-wide: every arbiter follows every hold and reports the same figure; 0 without one).",
                None,
                MetricType::Gauge,
            )?;
            for ((ns, class), (_, ms)) in &rows {
                ConstGauge::new(*ms as f64 / 1000.0).encode(family.encode_family(&pair(ns, class))?)?;
            }
            let mut family = encoder.encode_descriptor(
                "lockmesh_arbiter_open_holds",
                "Open holds by namespace and class, over every etcd cluster (fleet-wide, like lockmesh_arbiter_oldest_hold_seconds).",
                None,
                MetricType::Gauge,
            )?;
            for ((ns, class), (n, _)) in &rows {
                ConstGauge::new(i64::try_from(*n).unwrap_or(i64::MAX))
                    .encode(family.encode_family(&pair(ns, class))?)?;
            }
        }
        let gated = crate::lock::wait::gated(&self.0.quotas().lock_labels());
        {
            let mut family = encoder.encode_descriptor(
                "lockmesh_arbiter_gated_waiters",
                "Acquires waiting at this arbiter for a key at its limit or behind another waiter (gated), by namespace and class (per arbiter).",
                None,
                MetricType::Gauge,
            )?;
            for (l, g) in &gated {
                ConstGauge::new(i64::try_from(g.waiters).unwrap_or(i64::MAX))
                    .encode(family.encode_family(&pair(&l.namespace, &l.class))?)?;
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "lockmesh_arbiter_oldest_gated_wait_seconds",
                "How long the oldest acquire gated at this arbiter has been waiting, by namespace and class (per arbiter; 0 without one).",
                None,
                MetricType::Gauge,
            )?;
            for (l, g) in &gated {
                ConstGauge::new(g.oldest_ms as f64 / 1000.0)
                    .encode(family.encode_family(&pair(&l.namespace, &l.class))?)?;
            }
        }
        let figures = crate::lock::wait::FIGURES.all();
        {
            let mut family = encoder.encode_descriptor(
                "lockmesh_arbiter_wakeups_per_grant",
                "For each grant by this arbiter of a key with gated waiters here: how many times its waiters here woke to look again since its previous grant here (wake amplification; per arbiter).",
                None,
                MetricType::Histogram,
            )?;
            for (l, f) in &figures {
                f.wakeups.encode(family.encode_family(&pair(&l.namespace, &l.class))?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "lockmesh_arbiter_pickup_latency_seconds",
            "Time from the start of a release through this arbiter of a key with gated waiters here to the commit of its next grant here (one transaction for a hand-off; per arbiter).",
            None,
            MetricType::Histogram,
        )?;
        for (l, f) in &figures {
            f.pickup.encode(family.encode_family(&pair(&l.namespace, &l.class))?)?;
        }
        Ok(())
    }
}

/// The route label of a request path: a closed set.
pub(crate) fn route_label(method: &str, path: &str) -> &'static str {
    crate::api::Route::of(method.as_bytes(), path.as_bytes()).map_or("other", crate::api::Route::label)
}

/// The arbiter's registry and the families it records into.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Described<Family<RequestLabels, Counter>>,
    abandoned: Counter,
    waiting_keys: Gauge,
    sealed: Family<ReasonLabel, Gauge>,
    sealed_since: Gauge,
    acquires: Described<Family<AcquireLabels, Counter>>,
    grant_latency: Described<Family<LockLabels, Histogram, fn() -> Histogram>>,
    renewal_failures: Family<ReasonLabel, Counter>,
    /// The acquires answered by class (granted, refused), the same events as
    /// `acquires` summed over namespace and tier: the console's history reads them.
    by_class: RwLock<HashMap<String, Arc<ClassCounts>>>,
    /// The class families, set from the registry and the policy records at each scrape.
    pub(crate) classes: crate::registry::ClassMetrics,
    /// Held from setting the scrape-time values to encoding, so two scrapes do not interleave.
    scrape: Mutex<()>,
}

/// One class's acquires answered here.
#[derive(Debug, Default)]
struct ClassCounts {
    granted: AtomicU64,
    refused: AtomicU64,
}

/// A class's acquires answered here since the start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ClassTotals {
    /// Answered `granted`.
    pub granted: u64,
    /// Answered anything but `granted` and `cancelled` (the caller left).
    pub refused: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AcquireLabels {
    #[prometheus(flatten)]
    lock: LockLabels,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS.iter().copied())
}

/// The outcome label of an acquire: a closed set.
pub(crate) fn outcome_label<T>(r: &Result<T, crate::lock::LockError>) -> &'static str {
    use crate::lock::LockError as E;
    match r {
        Ok(_) => "granted",
        Err(E::Contended(lockmesh_core::Reason::KeyGated)) => "key_gated",
        Err(E::Contended(lockmesh_core::Reason::LockContended)) => "lock_contended",
        Err(E::Contended(lockmesh_core::Reason::LockDelay)) => "lock_delay",
        Err(E::Leaked) => "leaked",
        Err(E::SessionExpired | E::SessionClassMismatch { .. }) => "session",
        Err(E::Sealed(_)) => "sealed",
        Err(E::Unavailable(_) | E::Moved) => "unavailable",
        Err(E::Cancelled) => "cancelled",
        Err(E::Draining(_)) => "draining",
        Err(E::SpoolFull(_)) => "spool_full",
        Err(E::QuotaExceeded(_)) => "quota_exceeded",
        Err(E::CapabilityDisabled(_)) => "unavailable",
        Err(
            E::PermitsAboveLimit { .. }
            | E::BadKeys(_)
            | E::KeysSpanClusters(_)
            | E::NotElectionClass(_)
            | E::ModeConflict(_),
        ) => "bad_request",
        Err(E::NotHolder | E::Internal(_)) => "error",
    }
}

// === impl Metrics ===

impl Default for Metrics {
    /// Metrics over a runtime and a keyspace gate of their own (tests).
    fn default() -> Self {
        Self::new(Arc::default(), crate::lock::upgrade::Gate::new(crate::lock::upgrade::Support::full()))
    }
}

impl Metrics {
    /// The arbiter's metrics; the quota, wait and shadow families read `rt`, the
    /// keyspace families `gate`.
    pub fn new(rt: Arc<crate::lock::Runtime>, gate: Arc<crate::lock::upgrade::Gate>) -> Self {
        let m = Self {
            registry: Registry::default(),
            requests: Described::default(),
            abandoned: Counter::default(),
            waiting_keys: Gauge::default(),
            sealed: Family::default(),
            sealed_since: Gauge::default(),
            acquires: Described::default(),
            grant_latency: Described(Family::new_with_constructor(latency_histogram)),
            renewal_failures: Family::default(),
            by_class: RwLock::default(),
            classes: crate::registry::ClassMetrics::default(),
            scrape: Mutex::new(()),
        };
        for r in crate::lock::seal::SealReason::ALL {
            m.sealed.get_or_create_owned(&ReasonLabel { reason: r.as_str() });
        }
        for reason in ["expired", "unavailable"] {
            m.renewal_failures.get_or_create_owned(&ReasonLabel { reason });
        }
        m.registered(rt, gate)
    }

    fn registered(mut self, rt: Arc<crate::lock::Runtime>, gate: Arc<crate::lock::upgrade::Gate>) -> Self {
        let r = &mut self.registry;
        // prometheus-client appends `_total` to a counter's name and `.` to its help.
        r.register(
            "lockmesh_arbiter_requests",
            "API requests answered, by route and result code",
            self.requests.clone(),
        );
        r.register(
            "lockmesh_arbiter_abandoned_grants",
            "Grants released at once because the caller had gone",
            self.abandoned.clone(),
        );
        r.register(
            "lockmesh_arbiter_waiting_keys",
            "Keys with at least one waiter queued on this arbiter",
            self.waiting_keys.clone(),
        );
        r.register(
            "lockmesh_arbiter_sealed",
            "1 while the arbiter is sealed for this reason (restore safety)",
            self.sealed.clone(),
        );
        r.register(
            "lockmesh_arbiter_sealed_since_seconds",
            "Unix time the current seal was declared (0 when unsealed)",
            self.sealed_since.clone(),
        );
        crate::failopen::STATS.register(r);
        r.register(
            "lockmesh_arbiter_acquires",
            "Acquires answered, by outcome (granted, key_gated: the key is at its limit, lock_contended: lost a race, draining, sealed, ...)",
            self.acquires.clone(),
        );
        r.register(
            "lockmesh_arbiter_grant_latency_seconds",
            "Time from receiving an acquire to its grant, waits included",
            self.grant_latency.clone(),
        );
        r.register(
            "lockmesh_arbiter_renewal_failures",
            "Session keepalives refused (expired) or failed (unavailable)",
            self.renewal_failures.clone(),
        );
        self.classes.register(r);
        crate::lock::wait::HandoffCounts::register(r);
        r.register_collector(Box::new(EtcdCollector));
        crate::lock::upgrade::register(r, gate);
        crate::lock::quota::register(r, rt.quotas().clone());
        r.register_collector(Box::new(VmRenewalCollector));
        r.register_collector(Box::new(WaitCollector(rt.clone())));
        r.register_collector(Box::new(shadow::ShadowCollector(rt)));
        self
    }

    /// This arbiter's acquires answered `key_gated` and `lock_contended` under `labels`.
    pub(crate) fn refusals(&self, labels: &LockLabels) -> (u64, u64) {
        let n = |outcome| self.acquires.get(&AcquireLabels { lock: labels.clone(), outcome }).map_or(0, |c| c.get());
        (n("key_gated"), n("lock_contended"))
    }

    /// Counts one acquire by outcome, and its latency when granted.
    pub fn acquire(&self, labels: LockLabels, outcome: &'static str, seconds: f64) {
        if outcome == "granted" {
            self.grant_latency.get_or_create(&labels).observe(seconds);
        }
        if outcome != "cancelled" {
            let counts = self.class_counts(&labels.class);
            let n = if outcome == "granted" { &counts.granted } else { &counts.refused };
            n.fetch_add(1, Ordering::Relaxed);
        }
        self.acquires.get_or_create(&AcquireLabels { lock: labels, outcome }).inc();
    }

    /// The counts of `class` (created at 0).
    fn class_counts(&self, class: &str) -> Arc<ClassCounts> {
        if let Some(c) = self.by_class.read().unwrap_or_else(|p| p.into_inner()).get(class) {
            return c.clone();
        }
        let mut w = self.by_class.write().unwrap_or_else(|p| p.into_inner());
        w.entry(class.to_owned()).or_default().clone()
    }

    /// Every class's acquires answered here since the start (classes with one).
    pub(crate) fn class_totals(&self) -> BTreeMap<String, ClassTotals> {
        let r = self.by_class.read().unwrap_or_else(|p| p.into_inner());
        r.iter()
            .map(|(class, c)| {
                let t = ClassTotals {
                    granted: c.granted.load(Ordering::Relaxed),
                    refused: c.refused.load(Ordering::Relaxed),
                };
                (class.clone(), t)
            })
            .collect()
    }

    /// Counts a failed session renewal: `expired` (the session is gone) or
    /// `unavailable` (etcd did not answer).
    pub(crate) fn renewal_failure(&self, e: &crate::lock::LockError) {
        let reason = if matches!(e, crate::lock::LockError::SessionExpired) { "expired" } else { "unavailable" };
        self.renewal_failures.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Counts one answered request.
    pub fn request(&self, route: &'static str, code: &'static str) {
        self.requests.get_or_create(&RequestLabels { route, code }).inc();
    }

    /// Counts a grant undone because its caller left.
    pub fn abandoned(&self) {
        self.abandoned.inc();
    }

    /// The exposition text ([`CONTENT_TYPE`]), after setting the values known only
    /// now: `waiting_keys`, the seal (`seal`: reason and since, ms) and the class
    /// families (`classes`, read by `crate::registry::class_values`).
    pub fn encode(
        &self,
        waiting_keys: usize,
        seal: Option<(crate::lock::seal::SealReason, u64)>,
        classes: &crate::registry::ClassValues,
    ) -> Result<String, std::fmt::Error> {
        let _scrape = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        self.waiting_keys.set(i64::try_from(waiting_keys).unwrap_or(i64::MAX));
        for r in crate::lock::seal::SealReason::ALL {
            let v = i64::from(seal.is_some_and(|(sr, _)| sr == r));
            self.sealed.get_or_create(&ReasonLabel { reason: r.as_str() }).set(v);
        }
        self.sealed_since.set(seal.map_or(0, |(_, ms)| i64::try_from(ms / 1000).unwrap_or(i64::MAX)));
        self.classes.set(classes);
        let mut text = String::new();
        prometheus_text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_labels_come_from_the_registry() {
        let m = Metrics::default();
        let labels = LockLabels { namespace: "a".into(), class: "c".into(), tier: "entity" };
        for seconds in [0.0005, 0.002, 99.0] {
            m.acquire(labels.clone(), "granted", seconds);
        }
        let s = m.encode(0, None, &crate::registry::ClassValues::default()).unwrap();
        let series = "lockmesh_arbiter_grant_latency_seconds";
        let l = "namespace=\"a\",class=\"c\",tier=\"entity\"";
        assert!(s.contains(&format!("{series}_bucket{{{l},le=\"0.001\"}} 1\n")), "{s}");
        assert!(s.contains(&format!("{series}_bucket{{{l},le=\"0.0025\"}} 2\n")), "{s}");
        assert!(s.contains(&format!("{series}_bucket{{{l},le=\"30\"}} 2\n")), "{s}");
        assert!(s.contains(&format!("{series}_bucket{{{l},le=\"+Inf\"}} 3\n")), "{s}");
        assert!(s.contains(&format!("{series}_count{{{l}}} 3\n")), "{s}");
        assert!(s.contains(&format!("lockmesh_arbiter_acquires_total{{{l},outcome=\"granted\"}} 3\n")), "{s}");
        // The console's history reads the same events by class: refusals are every
        // outcome but granted and cancelled.
        for outcome in ["key_gated", "draining", "cancelled", "quota_exceeded"] {
            m.acquire(labels.clone(), outcome, 0.0);
        }
        m.acquire(LockLabels { namespace: "other".into(), ..labels.clone() }, "granted", 0.1);
        assert_eq!(m.class_totals().get("c"), Some(&ClassTotals { granted: 4, refused: 3 }));
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

    #[test]
    fn every_family_is_declared_before_its_first_event_and_fixed_label_sets_start_at_0() {
        let m = Metrics::default();
        let s = m.encode(2, None, &crate::registry::ClassValues::default()).unwrap();
        for family in [
            "lockmesh_arbiter_requests_total",
            "lockmesh_arbiter_acquires_total",
            "lockmesh_arbiter_grant_latency_seconds",
            "lockmesh_arbiter_unprotected_grants_total",
            "lockmesh_arbiter_class_waiver_expired",
            "lockmesh_arbiter_class_limit",
            "lockmesh_arbiter_class_draining_seconds",
        ] {
            assert!(s.contains(&format!("# HELP {family} ")), "{family}:\n{s}");
        }
        for line in [
            "lockmesh_arbiter_abandoned_grants_total 0\n",
            "lockmesh_arbiter_waiting_keys 2\n",
            "lockmesh_arbiter_sealed{reason=\"explicit\"} 0\n",
            "lockmesh_arbiter_sealed_since_seconds 0\n",
            "lockmesh_arbiter_renewal_failures_total{reason=\"expired\"} 0\n",
            "lockmesh_arbiter_renewal_failures_total{reason=\"unavailable\"} 0\n",
            "lockmesh_arbiter_handoffs_total{outcome=\"not_done\"} 0\n",
            "lockmesh_arbiter_handoff_offers 0\n",
            "lockmesh_arbiter_unprotected_refused_total{reason=\"io\"} 0\n",
            "lockmesh_arbiter_unprotected_ships_total{outcome=\"error\"} 0\n",
            "lockmesh_arbiter_quorum_loss_declared 0\n",
            "lockmesh_arbiter_etcd_check_failures_total 0\n",
            "# TYPE lockmesh_arbiter_vm_renewal_failures_total counter\n",
            "# TYPE lockmesh_arbiter_vm_sessions_in_jeopardy gauge\n",
            "lockmesh_arbiter_registry_reload_errors 0\n",
            "lockmesh_arbiter_registry_reloads_total 0\n",
            "# TYPE lockmesh_arbiter_quorum_lost_seconds gauge\n",
            "# TYPE lockmesh_arbiter_etcd_reachable gauge\n",
            // ADR-033: holds and waits by namespace and class (no pair before a registry).
            "# TYPE lockmesh_arbiter_oldest_hold_seconds gauge\n",
            "# TYPE lockmesh_arbiter_open_holds gauge\n",
            "# TYPE lockmesh_arbiter_gated_waiters gauge\n",
            "# TYPE lockmesh_arbiter_oldest_gated_wait_seconds gauge\n",
            "# TYPE lockmesh_arbiter_wakeups_per_grant histogram\n",
            "# TYPE lockmesh_arbiter_pickup_latency_seconds histogram\n",
            "# TYPE lockmesh_arbiter_etcd_check_seconds histogram\n",
            "lockmesh_arbiter_etcd_steps_total{step=\"handoff_txn\"} ",
            "lockmesh_arbiter_etcd_step_seconds_total{step=\"raft_check\"} ",
        ] {
            assert!(s.contains(line), "{line}:\n{s}");
        }
    }
}
