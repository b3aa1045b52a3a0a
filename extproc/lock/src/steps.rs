//! How long the etcd steps of a lock cycle take, as this arbiter sees them (issue
//! 20 item 1: where a cycle's time goes). Five steps, each a count and a total:
//!
//! | Step | The call |
//! |---|---|
//! | `grant_txn` | a grant's transaction ([`crate::Store::try_grant`]) |
//! | `handoff_txn` | a release that hands the key to the waiter that offered, in one transaction |
//! | `release_txn` | a plain release's transaction |
//! | `held_read` | the next head's read of a held mutex key's holders and limit (skipped when it could not answer the head, `crate::policy_watch`) |
//! | `raft_check` | the grant-time raft position check (ADR-03; only where etcd answers `Status`) |
//!
//! Each is timed from the call to its answer, including the wait for etcd's
//! commit, so a step's mean is etcd's latency for it plus the client's and the
//! network's. The arbiter exports them as `lockmesh_arbiter_etcd_step_seconds_total`
//! and `lockmesh_arbiter_etcd_steps_total` by `step` (a closed set); the load tool
//! prints the means per cycle beside its other figures. Two relaxed atomic adds per
//! call; no lock, no allocation.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// One timed etcd step of a lock cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    GrantTxn,
    HandoffTxn,
    ReleaseTxn,
    HeldRead,
    RaftCheck,
}

impl Step {
    /// Every step, in the order [`StepTimes::all`] answers.
    pub const ALL: [Step; 5] = [Step::GrantTxn, Step::HandoffTxn, Step::ReleaseTxn, Step::HeldRead, Step::RaftCheck];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Step::GrantTxn => "grant_txn",
            Step::HandoffTxn => "handoff_txn",
            Step::ReleaseTxn => "release_txn",
            Step::HeldRead => "held_read",
            Step::RaftCheck => "raft_check",
        }
    }
}

/// Counts and total time of each [`Step`] since the process started.
#[derive(Debug)]
pub struct StepTimes {
    count: [AtomicU64; 5],
    nanos: [AtomicU64; 5],
}

/// This process's step times.
pub static STEPS: StepTimes =
    StepTimes { count: [const { AtomicU64::new(0) }; 5], nanos: [const { AtomicU64::new(0) }; 5] };

impl StepTimes {
    /// Records one call of `step` that took `took` (answered or failed).
    pub fn observe(&self, step: Step, took: Duration) {
        let i = step as usize;
        self.count[i].fetch_add(1, Relaxed);
        self.nanos[i].fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    /// Each step with its count and total seconds.
    pub fn all(&self) -> [(Step, u64, f64); 5] {
        Step::ALL.map(|s| {
            let i = s as usize;
            (s, self.count[i].load(Relaxed), self.nanos[i].load(Relaxed) as f64 / 1e9)
        })
    }
}

/// Times `f` as one call of `step` in [`STEPS`].
pub(crate) async fn timed<T>(step: Step, f: impl std::future::Future<Output = T>) -> T {
    let started = tokio::time::Instant::now();
    let out = f.await;
    STEPS.observe(step, started.elapsed());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_step_counts_its_own_calls_and_time() {
        let t = StepTimes { count: [const { AtomicU64::new(0) }; 5], nanos: [const { AtomicU64::new(0) }; 5] };
        t.observe(Step::HandoffTxn, Duration::from_micros(800));
        t.observe(Step::HandoffTxn, Duration::from_micros(400));
        t.observe(Step::RaftCheck, Duration::from_micros(250));
        let all = t.all();
        let get = |s: Step| all.iter().find(|(x, _, _)| *x == s).map(|(_, n, secs)| (*n, *secs)).unwrap();
        assert_eq!(get(Step::HandoffTxn).0, 2);
        assert!((get(Step::HandoffTxn).1 - 0.0012).abs() < 1e-9);
        assert_eq!(get(Step::RaftCheck), (1, 0.00025));
        assert_eq!(get(Step::GrantTxn), (0, 0.0));
        let labels: Vec<_> = Step::ALL.iter().map(|s| s.label()).collect();
        assert_eq!(labels, ["grant_txn", "handoff_txn", "release_txn", "held_read", "raft_check"]);
    }
}
