//! The arbiter's etcd steps during a measured window, from its own counters
//! (`lockmesh_arbiter_etcd_step_seconds_total` and `lockmesh_arbiter_etcd_steps_total`
//! by `step`, `lockmesh_lock::steps`): per cycle, how many calls of each step
//! (grant, hand-off and release transactions, the next head's read, the raft
//! check) and their mean latency. The arbiter half of a cycle's profile, beside
//! etcd's own counters ([`crate::etcdwork`]): which etcd round trips a cycle waits
//! on, and how long each takes as the arbiter sees it.

use std::collections::BTreeMap;

use crate::prom;

/// The step counters read once: step → (calls, seconds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepCounters(BTreeMap<String, (f64, f64)>);

/// Between two readings: step → (calls per cycle, mean ms), steps with calls only.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepWork(pub BTreeMap<String, (f64, f64)>);

const SECONDS: &str = "lockmesh_arbiter_etcd_step_seconds_total";
const CALLS: &str = "lockmesh_arbiter_etcd_steps_total";

// === impl StepCounters ===

impl StepCounters {
    /// The arbiter's counters from its admin port; `None` when unreadable or absent.
    pub(crate) async fn read(admin_port: u16) -> Option<Self> {
        let resp = lockmesh_tests::probe::http_get(admin_port, "/metrics").await.ok()?;
        Self::parse(&resp.body)
    }

    fn parse(text: &str) -> Option<Self> {
        let mut by_step: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        for s in prom::parse(text) {
            let Some(step) = s.label("step") else { continue };
            let e = by_step.entry(step.to_owned()).or_default();
            match s.name.as_str() {
                CALLS => e.0 = s.value,
                SECONDS => e.1 = s.value,
                _ => {}
            }
        }
        (!by_step.is_empty()).then_some(Self(by_step))
    }

    /// What happened between `before` and this reading, per cycle.
    pub(crate) fn per_cycle_since(&self, before: &Self, cycles: u64) -> Option<StepWork> {
        if cycles == 0 {
            return None;
        }
        let n = cycles as f64;
        let steps = self
            .0
            .iter()
            .filter_map(|(step, (calls, secs))| {
                let (c0, s0) = before.0.get(step).copied().unwrap_or_default();
                let calls = calls - c0;
                (calls >= 1.0).then(|| (step.clone(), (calls / n, (secs - s0) * 1000.0 / calls)))
            })
            .collect();
        Some(StepWork(steps))
    }
}

// === impl StepWork ===

impl StepWork {
    /// `handoff_txn 0.95 x 0.80 ms, raft_check 1.00 x 0.25 ms; 1.01 ms in all`
    /// (calls per cycle x mean latency; in all: the arbiter's etcd time per cycle,
    /// not all of it on one request's path).
    pub fn summary(&self) -> String {
        if self.0.is_empty() {
            return "none".into();
        }
        let parts: Vec<String> =
            self.0.iter().map(|(step, (calls, ms))| format!("{step} {calls:.2} x {ms:.3} ms")).collect();
        let total: f64 = self.0.values().map(|(calls, ms)| calls * ms).sum();
        format!("{}; {total:.3} ms in all", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# HELP lockmesh_arbiter_etcd_step_seconds x
lockmesh_arbiter_etcd_step_seconds_total{step="grant_txn"} 1.0
lockmesh_arbiter_etcd_step_seconds_total{step="handoff_txn"} 2.0
lockmesh_arbiter_etcd_step_seconds_total{step="raft_check"} 0.5
lockmesh_arbiter_etcd_steps_total{step="grant_txn"} 100
lockmesh_arbiter_etcd_steps_total{step="handoff_txn"} 2000
lockmesh_arbiter_etcd_steps_total{step="raft_check"} 2100
lockmesh_arbiter_etcd_check_seconds_sum 3.5
"#;

    const AFTER: &str = r#"lockmesh_arbiter_etcd_step_seconds_total{step="grant_txn"} 1.0
lockmesh_arbiter_etcd_step_seconds_total{step="handoff_txn"} 2.8
lockmesh_arbiter_etcd_step_seconds_total{step="raft_check"} 0.75
lockmesh_arbiter_etcd_steps_total{step="grant_txn"} 100
lockmesh_arbiter_etcd_steps_total{step="handoff_txn"} 3000
lockmesh_arbiter_etcd_steps_total{step="raft_check"} 3100
"#;

    #[test]
    fn steps_per_cycle_and_their_mean_latency_between_two_readings() {
        let (b, a) = (StepCounters::parse(BEFORE).unwrap(), StepCounters::parse(AFTER).unwrap());
        let w = a.per_cycle_since(&b, 1000).unwrap();
        // A step without calls in the window is left out.
        assert_eq!(w.0.keys().collect::<Vec<_>>(), ["handoff_txn", "raft_check"]);
        let (calls, ms) = w.0["handoff_txn"];
        assert!((calls - 1.0).abs() < 1e-9 && (ms - 0.8).abs() < 1e-9, "{calls} {ms}");
        let (calls, ms) = w.0["raft_check"];
        assert!((calls - 1.0).abs() < 1e-9 && (ms - 0.25).abs() < 1e-9, "{calls} {ms}");
        assert_eq!(w.summary(), "handoff_txn 1.00 x 0.800 ms, raft_check 1.00 x 0.250 ms; 1.050 ms in all");
        assert_eq!(a.per_cycle_since(&b, 0), None);
        assert_eq!(StepCounters::parse("etcd_server_proposals_committed_total 5\n"), None);
    }
}
