//! TEST ONLY: planted bugs for the release gate (`docs/GATE.md`).
//!
//! A gate that cannot catch a bug proves nothing, so the gate's targeted
//! scenarios turn these on and check that the checker fails. They are switched
//! on by the arbiter config field `test_faults: [..]`, which is refused unless
//! the environment sets `LOCKMESH_TEST_FAULTS=1`, and logged at `error` level at
//! startup. No shipped config names them.

use std::sync::OnceLock;

/// The environment variable that must be `1` for `test_faults` to be accepted.
pub const ENV: &str = "LOCKMESH_TEST_FAULTS";

/// One planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestFault {
    /// Grants do not compare the epoch record: a grant may carry an epoch that is
    /// no longer current at its commit (an epoch advance during a restore).
    SkipEpochCompare,
    /// Release of a mutex hold on the caller's session deletes slot 0 by name,
    /// without comparing the grant: a stale release frees a successor (etcd #22082).
    ReleaseByKeyName,
    /// A semaphore grant counts the holders, then puts its own hold without
    /// comparing the count: racing grants exceed N.
    CountBeforeLock,
    /// The home fence admits a key its cluster's record homes elsewhere, and the
    /// arbiter never re-reads the shard map (`lock::home`, `tiers`): after a move,
    /// grants routed by the stale map commit on the keys' old home.
    SkipHomeGate,
}

static ACTIVE: OnceLock<Vec<TestFault>> = OnceLock::new();

// === impl TestFault ===

impl TestFault {
    /// Parses a config name (`skip_epoch_compare`, `release_by_key_name`,
    /// `count_before_lock`, `skip_home_gate`).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "skip_epoch_compare" => Some(Self::SkipEpochCompare),
            "release_by_key_name" => Some(Self::ReleaseByKeyName),
            "count_before_lock" => Some(Self::CountBeforeLock),
            "skip_home_gate" => Some(Self::SkipHomeGate),
            _ => None,
        }
    }
}

/// Installs the planted bugs for this process (once; later calls are ignored).
pub fn install(faults: &[TestFault]) {
    if faults.is_empty() {
        return;
    }
    for f in faults {
        tracing::error!(fault = ?f, "TEST FAULT PLANTED: this arbiter is deliberately unsafe (release gate only)");
    }
    let _ = ACTIVE.set(faults.to_vec());
}

/// Whether `fault` is planted in this process.
pub fn on(fault: TestFault) -> bool {
    ACTIVE.get().is_some_and(|v| v.contains(&fault))
}
