//! The tailer's metrics (`/metrics` on its admin port), encoded by
//! prometheus-client in the Prometheus text format 0.0.4 ([`CONTENT_TYPE`]).
//! Labels: event kind, how a hold ended, and namespace/class/tier from the
//! registry (never a key, session or identity). The counters and the hold
//! histogram are recorded as events commit; the gauges are set from the tailer's
//! state at each scrape ([`Stats::encode`]).

use std::{
    collections::{BTreeMap, HashMap},
    sync::{atomic::AtomicU64, Mutex},
};

use lockmesh_core::ClassRegistry;
use prometheus_client::{
    encoding::{prometheus_text, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use tokio::time::Instant;

use super::event::{AuditEvent, EventKind};
use lockmesh_telemetry::labels::{labels_of_raw, Described, LockLabels, HOLD_BUCKETS};

/// The `Content-Type` of [`Stats::encode`]'s text.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Shared tailer statistics: the tailer's state and the metric families.
#[derive(Debug)]
pub struct Stats {
    inner: Mutex<Inner>,
    registry: Registry,
    m: Families,
}

#[derive(Debug, Default)]
struct Inner {
    leader: bool,
    applied: i64,
    head: i64,
    behind_since: Option<Instant>,
    checkpoint_ms: u64,
    window_s: u64,
    alarmed: bool,
    /// Open holds: hold id -> (labels, granted_ms).
    open: HashMap<String, (LockLabels, u64)>,
}

type F64Gauge = Gauge<f64, AtomicU64>;

/// The families; clones registered in [`Stats::registry`] share their values.
#[derive(Debug, Clone)]
struct Families {
    leader: Gauge,
    applied_revision: Gauge,
    head_revision: Gauge,
    lag_revisions: Gauge,
    lag_seconds: F64Gauge,
    compaction_window_seconds: Gauge,
    lag_alarm: Gauge,
    checkpoint_age_seconds: F64Gauge,
    events: Family<KindLabel, Counter>,
    replayed: Counter,
    gaps: Counter,
    restores: Counter,
    expiries: Described<Family<LockLabels, Counter>>,
    hold_seconds: Described<Family<HoldLabels, Histogram, fn() -> Histogram>>,
    open_holds: Described<Family<LockLabels, Gauge>>,
    oldest_open_hold_seconds: Described<Family<LockLabels, F64Gauge>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HoldLabels {
    #[prometheus(flatten)]
    lock: LockLabels,
    end: &'static str,
}

fn hold_histogram() -> Histogram {
    Histogram::new(HOLD_BUCKETS.iter().copied())
}

fn hold_id(e: &AuditEvent) -> Option<String> {
    Some(format!("{}/{}/{}", e.timeline, e.grant_revision?, e.etcd_key))
}

// === impl Stats ===

impl Default for Stats {
    fn default() -> Self {
        let m = Families {
            leader: Gauge::default(),
            applied_revision: Gauge::default(),
            head_revision: Gauge::default(),
            lag_revisions: Gauge::default(),
            lag_seconds: F64Gauge::default(),
            compaction_window_seconds: Gauge::default(),
            lag_alarm: Gauge::default(),
            checkpoint_age_seconds: F64Gauge::default(),
            events: Family::default(),
            replayed: Counter::default(),
            gaps: Counter::default(),
            restores: Counter::default(),
            expiries: Described::default(),
            hold_seconds: Described(Family::new_with_constructor(hold_histogram)),
            open_holds: Described::default(),
            oldest_open_hold_seconds: Described::default(),
        };
        for k in EventKind::ALL {
            m.events.get_or_create_owned(&KindLabel { kind: k.as_str() });
        }
        let mut r = Registry::default();
        let f = m.clone();
        // prometheus-client appends `_total` to a counter's name and `.` to its help.
        r.register("lockmesh_audit_leader", "1 while this replica holds the tailer election", f.leader);
        r.register(
            "lockmesh_audit_applied_revision",
            "Last etcd revision whose events are stored with the checkpoint",
            f.applied_revision,
        );
        r.register(
            "lockmesh_audit_head_revision",
            "Highest etcd revision the tailer has seen in a response header",
            f.head_revision,
        );
        r.register(
            "lockmesh_audit_lag_revisions",
            "Revisions between the cluster's head and the checkpoint",
            f.lag_revisions,
        );
        r.register(
            "lockmesh_audit_lag_seconds",
            "How long the checkpoint has been behind the cluster's head (0 when caught up)",
            f.lag_seconds,
        );
        r.register(
            "lockmesh_audit_compaction_window_seconds",
            "etcd's compaction window as configured; the alarm fires at half of it",
            f.compaction_window_seconds,
        );
        r.register(
            "lockmesh_audit_lag_alarm",
            "1 while the lag is at least half the compaction window (history is at risk)",
            f.lag_alarm,
        );
        r.register(
            "lockmesh_audit_checkpoint_age_seconds",
            "Time since the last checkpoint commit",
            f.checkpoint_age_seconds,
        );
        r.register("lockmesh_audit_events", "Audit events stored (first time), by kind", f.events);
        r.register(
            "lockmesh_audit_replayed_events",
            "Events derived again after a restart (overwrote their own rows)",
            f.replayed,
        );
        r.register(
            "lockmesh_audit_gaps",
            "Gaps recorded (history compacted past the checkpoint, or another cluster)",
            f.gaps,
        );
        r.register("lockmesh_audit_restores", "Restores detected (cluster revision behind the checkpoint)", f.restores);
        r.register("lockmesh_audit_expiries", "Holds that ended by session expiry without a release", f.expiries);
        r.register("lockmesh_audit_hold_seconds", "How long holds were held, by how they ended", f.hold_seconds);
        r.register("lockmesh_audit_open_holds", "Holds open as the audit log shows them", f.open_holds);
        r.register(
            "lockmesh_audit_oldest_open_hold_seconds",
            "Age of the oldest open hold",
            f.oldest_open_hold_seconds,
        );
        Self { inner: Mutex::default(), registry: r, m }
    }
}

impl Stats {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Sets the compaction window the lag alarm compares with.
    pub(crate) fn set_window(&self, s: u64) {
        self.with(|i| i.window_s = s);
    }

    /// Records whether this tailer is the leader now.
    pub(crate) fn set_leader(&self, leader: bool) {
        self.with(|i| i.leader = leader);
    }

    /// Counts committed events (new and replayed) and follows holds.
    pub fn committed(
        &self,
        events: &[AuditEvent],
        new: usize,
        replayed: usize,
        reg: Option<&ClassRegistry>,
        now_ms: u64,
    ) {
        let m = &self.m;
        self.with(|i| {
            m.replayed.inc_by(replayed as u64);
            if new == 0 {
                return;
            }
            for e in events {
                m.events.get_or_create(&KindLabel { kind: e.kind.as_str() }).inc();
                let labels = match (reg, &e.key) {
                    (Some(r), Some(k)) => labels_of_raw(r, k),
                    _ => LockLabels {
                        namespace: "other".into(),
                        class: e.class.clone().filter(|_| reg.is_none()).unwrap_or_else(|| "other".into()),
                        tier: "entity",
                    },
                };
                match e.kind {
                    EventKind::Gap => {
                        m.gaps.inc();
                    }
                    EventKind::Restore => {
                        m.restores.inc();
                    }
                    EventKind::Grant => {
                        if let Some(id) = hold_id(e) {
                            i.open.insert(id, (labels, e.at_ms));
                        }
                    }
                    k if k.ends_hold() => {
                        if k == EventKind::Expiry {
                            m.expiries.get_or_create(&labels).inc();
                        }
                        if let Some((_, granted)) = hold_id(e).and_then(|id| i.open.remove(&id)) {
                            let held = now_ms.max(e.at_ms).saturating_sub(granted) as f64 / 1000.0;
                            m.hold_seconds.get_or_create(&HoldLabels { lock: labels, end: k.as_str() }).observe(held);
                        }
                    }
                    _ => {}
                }
            }
        });
    }

    /// Replaces the open holds (startup, or after a gap: read from etcd).
    pub(crate) fn reset_open(&self, open: Vec<(String, LockLabels, u64)>) {
        self.with(|i| i.open = open.into_iter().map(|(id, l, t)| (id, (l, t))).collect());
    }

    /// The revision all events are stored up to, and the cluster's head.
    /// Returns true when the lag alarm is raised by this call (log once).
    pub fn progress(&self, applied: i64, head: i64, checkpoint_ms: u64) -> bool {
        self.with(|i| {
            i.applied = applied;
            i.head = i.head.max(head);
            i.checkpoint_ms = checkpoint_ms;
            if applied >= i.head {
                i.behind_since = None;
            } else if i.behind_since.is_none() {
                i.behind_since = Some(Instant::now());
            }
            let alarm = Self::lag(i) * 2.0 >= i.window_s as f64 && i.window_s > 0;
            let raised = alarm && !i.alarmed;
            i.alarmed = alarm;
            raised
        })
    }

    fn lag(i: &Inner) -> f64 {
        i.behind_since.map_or(0.0, |t| t.elapsed().as_secs_f64())
    }

    /// Seconds the tailer has been behind the cluster's head.
    pub(crate) fn lag_seconds(&self) -> f64 {
        self.with(|i| Self::lag(i))
    }

    /// The exposition text ([`CONTENT_TYPE`]), the gauges set from the state at `now_ms`.
    pub fn encode(&self, now_ms: u64) -> Result<String, std::fmt::Error> {
        let m = &self.m;
        // Held while encoding too, so two scrapes do not interleave their open-hold families.
        self.with(|i| {
            m.leader.set(i64::from(i.leader));
            m.applied_revision.set(i.applied);
            m.head_revision.set(i.head);
            m.lag_revisions.set((i.head - i.applied).max(0));
            m.lag_seconds.set(Self::lag(i));
            m.compaction_window_seconds.set(i64::try_from(i.window_s).unwrap_or(i64::MAX));
            m.lag_alarm.set(i64::from(i.alarmed));
            m.checkpoint_age_seconds.set(now_ms.saturating_sub(i.checkpoint_ms) as f64 / 1000.0);
            let mut oldest: BTreeMap<&LockLabels, (u64, i64)> = BTreeMap::new();
            for (l, t) in i.open.values() {
                let e = oldest.entry(l).or_insert((u64::MAX, 0));
                e.0 = e.0.min(*t);
                e.1 += 1;
            }
            m.open_holds.clear();
            m.oldest_open_hold_seconds.clear();
            for (l, (t, n)) in oldest {
                m.open_holds.get_or_create(l).set(n);
                m.oldest_open_hold_seconds.get_or_create(l).set(now_ms.saturating_sub(t) as f64 / 1000.0);
            }
            let mut text = String::new();
            prometheus_text::encode(&mut text, &self.registry)?;
            Ok(text)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: EventKind, key: &str, at_ms: u64) -> AuditEvent {
        AuditEvent {
            cluster_id: "c".into(),
            timeline: 1,
            epoch: 1,
            revision: 7,
            etcd_key: "/lm/h/d/0".into(),
            kind,
            digest: None,
            key: Some(key.into()),
            identity: None,
            instance: None,
            class: Some("batch".into()),
            session: None,
            grant_revision: Some(7),
            slot: None,
            at_ms,
            detail: None,
            unprotected: false,
        }
    }

    #[test]
    fn the_exposition_counts_kinds_from_0_and_follows_holds_with_bounded_labels() {
        let st = Stats::default();
        let key = "jobs/secret-order-1";
        let l = "namespace=\"other\",class=\"batch\",tier=\"entity\"";
        st.committed(&[event(EventKind::Grant, key, 1_000)], 1, 0, None, 1_000);
        let text = st.encode(3_500).unwrap();
        assert!(text.contains("lockmesh_audit_events_total{kind=\"grant\"} 1\n"), "{text}");
        assert!(text.contains("lockmesh_audit_events_total{kind=\"gap\"} 0\n"), "{text}");
        assert!(text.contains(&format!("lockmesh_audit_open_holds{{{l}}} 1\n")), "{text}");
        assert!(text.contains(&format!("lockmesh_audit_oldest_open_hold_seconds{{{l}}} 2.5\n")), "{text}");
        assert!(text.contains("# TYPE lockmesh_audit_expiries_total counter\n"), "{text}");
        st.committed(&[event(EventKind::Expiry, key, 4_000)], 1, 2, None, 4_000);
        let text = st.encode(5_000).unwrap();
        assert!(text.contains(&format!("lockmesh_audit_expiries_total{{{l}}} 1\n")), "{text}");
        assert!(text.contains(&format!("lockmesh_audit_hold_seconds_bucket{{{l},end=\"expiry\",le=\"5\"}} 1\n")));
        assert!(text.contains(&format!("lockmesh_audit_hold_seconds_count{{{l},end=\"expiry\"}} 1\n")), "{text}");
        assert!(text.contains("lockmesh_audit_replayed_events_total 2\n"), "{text}");
        // The hold ended: its open-hold series are gone, the families still declared.
        assert!(!text.contains("lockmesh_audit_open_holds{"), "{text}");
        assert!(text.contains("# HELP lockmesh_audit_open_holds "), "{text}");
        assert!(!text.contains(key), "a key in the metrics: {text}");
    }
}
