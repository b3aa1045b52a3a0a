//! The tailer's metrics (`/metrics` on its admin port). Labels: event kind, and
//! namespace/class/tier from the registry (never a key, session or identity).

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write,
    sync::Mutex,
};

use lockmesh_core::ClassRegistry;
use tokio::time::Instant;

use super::event::{AuditEvent, EventKind};
use lockmesh_telemetry::labels::{labels_of_raw, Histogram, LockLabels, HOLD_BUCKETS};

/// Shared tailer statistics.
#[derive(Default)]
pub struct Stats(Mutex<Inner>);

#[derive(Default)]
struct Inner {
    events: BTreeMap<&'static str, u64>,
    replayed: u64,
    gaps: u64,
    restores: u64,
    leader: bool,
    applied: i64,
    head: i64,
    behind_since: Option<Instant>,
    checkpoint_ms: u64,
    window_s: u64,
    alarmed: bool,
    expiries: BTreeMap<LockLabels, u64>,
    hold_seconds: BTreeMap<(LockLabels, &'static str), Histogram>,
    /// Open holds: hold id -> (labels, granted_ms).
    open: HashMap<String, (LockLabels, u64)>,
}

fn hold_id(e: &AuditEvent) -> Option<String> {
    Some(format!("{}/{}/{}", e.timeline, e.grant_revision?, e.etcd_key))
}

// === impl Stats ===

impl Stats {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Sets the compaction window the lag alarm compares with.
    pub fn set_window(&self, s: u64) {
        self.with(|i| i.window_s = s);
    }

    /// Leadership changed.
    pub fn set_leader(&self, leader: bool) {
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
        self.with(|i| {
            i.replayed += replayed as u64;
            if new == 0 {
                return;
            }
            for e in events {
                *i.events.entry(e.kind.as_str()).or_default() += 1;
                let labels = match (reg, &e.key) {
                    (Some(r), Some(k)) => labels_of_raw(r, k),
                    _ => LockLabels {
                        namespace: "other".into(),
                        class: e.class.clone().filter(|_| reg.is_none()).unwrap_or_else(|| "other".into()),
                        tier: "entity",
                    },
                };
                match e.kind {
                    EventKind::Gap => i.gaps += 1,
                    EventKind::Restore => i.restores += 1,
                    EventKind::Grant => {
                        if let Some(id) = hold_id(e) {
                            i.open.insert(id, (labels, e.at_ms));
                        }
                    }
                    k if k.ends_hold() => {
                        if k == EventKind::Expiry {
                            *i.expiries.entry(labels.clone()).or_default() += 1;
                        }
                        if let Some((_, granted)) = hold_id(e).and_then(|id| i.open.remove(&id)) {
                            let held = now_ms.max(e.at_ms).saturating_sub(granted) as f64 / 1000.0;
                            i.hold_seconds
                                .entry((labels, k.as_str()))
                                .or_insert_with(|| Histogram::new(HOLD_BUCKETS))
                                .observe(held);
                        }
                    }
                    _ => {}
                }
            }
        });
    }

    /// Replaces the open holds (startup, or after a gap: read from etcd).
    pub fn reset_open(&self, open: Vec<(String, LockLabels, u64)>) {
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
    pub fn lag_seconds(&self) -> f64 {
        self.with(|i| Self::lag(i))
    }

    /// The exposition.
    pub fn render(&self, now_ms: u64) -> String {
        self.with(|i| {
            let mut s = String::new();
            let mut g = |name: &str, help: &str, v: String| {
                let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
            };
            g("lockmesh_audit_leader", "1 while this replica holds the tailer election.", u8::from(i.leader).to_string());
            g("lockmesh_audit_applied_revision", "Last etcd revision whose events are stored with the checkpoint.", i.applied.to_string());
            g("lockmesh_audit_head_revision", "Highest etcd revision the tailer has seen in a response header.", i.head.to_string());
            g("lockmesh_audit_lag_revisions", "Revisions between the cluster's head and the checkpoint.", (i.head - i.applied).max(0).to_string());
            g("lockmesh_audit_lag_seconds", "How long the checkpoint has been behind the cluster's head (0 when caught up).", format!("{:.3}", Self::lag(i)));
            g("lockmesh_audit_compaction_window_seconds", "etcd's compaction window as configured; the alarm fires at half of it.", i.window_s.to_string());
            g("lockmesh_audit_lag_alarm", "1 while the lag is at least half the compaction window (history is at risk).", u8::from(i.alarmed).to_string());
            g("lockmesh_audit_checkpoint_age_seconds", "Time since the last checkpoint commit.", format!("{:.3}", now_ms.saturating_sub(i.checkpoint_ms) as f64 / 1000.0));
            let _ = writeln!(s, "# HELP lockmesh_audit_events_total Audit events stored (first time), by kind.\n# TYPE lockmesh_audit_events_total counter");
            for k in EventKind::ALL {
                let _ = writeln!(s, "lockmesh_audit_events_total{{kind=\"{}\"}} {}", k.as_str(), i.events.get(k.as_str()).copied().unwrap_or(0));
            }
            let mut c = |name: &str, help: &str, v: u64| {
                let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
            };
            c("lockmesh_audit_replayed_events_total", "Events derived again after a restart (overwrote their own rows).", i.replayed);
            c("lockmesh_audit_gaps_total", "Gaps recorded (history compacted past the checkpoint, or another cluster).", i.gaps);
            c("lockmesh_audit_restores_total", "Restores detected (cluster revision behind the checkpoint).", i.restores);
            let _ = writeln!(s, "# HELP lockmesh_audit_expiries_total Holds that ended by session expiry without a release.\n# TYPE lockmesh_audit_expiries_total counter");
            for (l, n) in &i.expiries {
                let _ = writeln!(s, "lockmesh_audit_expiries_total{{{}}} {n}", l.render());
            }
            let _ = writeln!(s, "# HELP lockmesh_audit_hold_seconds How long holds were held, by how they ended.\n# TYPE lockmesh_audit_hold_seconds histogram");
            for ((l, end), h) in &i.hold_seconds {
                h.render(&mut s, "lockmesh_audit_hold_seconds", &format!("{},end=\"{end}\"", l.render()));
            }
            let mut oldest: BTreeMap<&LockLabels, (u64, u64)> = BTreeMap::new();
            for (l, t) in i.open.values() {
                let e = oldest.entry(l).or_insert((u64::MAX, 0));
                e.0 = e.0.min(*t);
                e.1 += 1;
            }
            let _ = writeln!(s, "# HELP lockmesh_audit_open_holds Holds open as the audit log shows them.\n# TYPE lockmesh_audit_open_holds gauge");
            for (l, (_, n)) in &oldest {
                let _ = writeln!(s, "lockmesh_audit_open_holds{{{}}} {n}", l.render());
            }
            let _ = writeln!(s, "# HELP lockmesh_audit_oldest_open_hold_seconds Age of the oldest open hold.\n# TYPE lockmesh_audit_oldest_open_hold_seconds gauge");
            for (l, (t, _)) in &oldest {
                let _ = writeln!(s, "lockmesh_audit_oldest_open_hold_seconds{{{}}} {:.3}", l.render(), now_ms.saturating_sub(*t) as f64 / 1000.0);
            }
            s
        })
    }
}
