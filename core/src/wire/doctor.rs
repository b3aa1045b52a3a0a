//! What `lockctl doctor --json` prints (`extproc/src/doctor.rs`): every finding of
//! one look at the deployment. Members in the order it prints them.

use serde::{Deserialize, Serialize};

/// The whole report. The exit code follows from it: 1 when `failures` is above 0.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoctorReport {
    /// The version of the `lockctl` that ran the checks.
    pub lockctl_version: String,
    /// The etcd key root checked.
    pub root: String,
    /// Every finding, in check order.
    pub findings: Vec<Finding>,
    /// Findings with verdict `fail`.
    pub failures: u64,
    /// Findings with verdict `warn`.
    pub warnings: u64,
}

/// One finding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// The check, e.g. `class.draining` (the table in `extproc/src/doctor.rs`).
    pub check: String,
    /// Its verdict.
    pub status: Verdict,
    /// What it is about: a class, an etcd member, an arbiter URL, or `-`.
    pub subject: String,
    /// What was found and, when something is wrong, what to do.
    pub detail: String,
}

/// A check's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Fine.
    Ok,
    /// Worth a look; does not fail the run.
    Warn,
    /// Something is wrong: the run exits 1.
    Fail,
    /// Not checked (the input it needs was not given or not reachable).
    Skip,
}
