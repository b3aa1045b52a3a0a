//! TEST ONLY: planted faults of the audit tailer, for the scenarios that must
//! catch them (`tests/tests/scenarios/audit_clickhouse.rs`, `audit_archive.rs`).
//!
//! As the arbiter's (`lockmesh_lock::test_faults`): compiled in only with the
//! cargo feature `test-faults`, which only the test harness turns on
//! (`lockmesh-tests`). Without it, [`on`] is a constant `false` (every planted
//! branch is dead code), [`TestFault::parse`] knows no fault and [`install`]
//! plants nothing: a shipped tailer cannot be configured into a faulty one. They
//! are switched on by the config field `test_faults: [..]`, refused unless the
//! environment sets `LOCKMESH_TEST_FAULTS=1`, and logged at `error` at startup.

#[cfg(feature = "test-faults")]
use std::sync::OnceLock;

/// The environment variable that must be `1` for `test_faults` to be accepted.
pub(crate) const ENV: &str = "LOCKMESH_TEST_FAULTS";

/// One planted fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestFault {
    /// The ClickHouse sink leaves the `identity` column out of every row it
    /// inserts (`clickhouse::Sink::rows`): the table then has the column's
    /// default (NULL) where the embedded store has the holder.
    ClickHouseDropsColumn,
    /// Not a bug: after ClickHouse accepted the first batch with events of this
    /// process, the tailer logs `AUDIT TEST: batch sent to clickhouse` and waits
    /// 3 s before the embedded store commits it, so a scenario can kill it in
    /// between and see the batch sent again after the restart ([`pause_once`]).
    PauseAfterSink,
    /// The archiver leaves out the last day with ended holds (`archive::Archiver::pass`):
    /// the current, partial day never reaches the grants bucket.
    ArchiveSkipsLastDay,
    /// The query port answers from the embedded store although ClickHouse is the
    /// configured store (`reader::ClickHouseReader::answer`), still naming
    /// ClickHouse in its `x-lockmesh-audit-store` header.
    QueryPortReadsEmbedded,
}

#[cfg(feature = "test-faults")]
static ACTIVE: OnceLock<Vec<TestFault>> = OnceLock::new();

// === impl TestFault ===

impl TestFault {
    /// Parses a config name (`clickhouse_drops_column`, `pause_after_sink`).
    #[cfg(feature = "test-faults")]
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "clickhouse_drops_column" => Some(Self::ClickHouseDropsColumn),
            "pause_after_sink" => Some(Self::PauseAfterSink),
            "archive_skips_last_day" => Some(Self::ArchiveSkipsLastDay),
            "query_port_reads_embedded" => Some(Self::QueryPortReadsEmbedded),
            _ => None,
        }
    }

    /// A build without the feature `test-faults` knows no planted fault.
    #[cfg(not(feature = "test-faults"))]
    pub fn parse(_name: &str) -> Option<Self> {
        None
    }
}

/// Installs the planted faults for this process (once; later calls are ignored).
#[cfg(feature = "test-faults")]
pub fn install(faults: &[TestFault]) {
    if faults.is_empty() {
        return;
    }
    for f in faults {
        tracing::error!(fault = ?f, "TEST FAULT PLANTED: this audit tailer is deliberately faulty (tests only)");
    }
    let _ = ACTIVE.set(faults.to_vec());
}

/// Without the feature there is nothing to install.
#[cfg(not(feature = "test-faults"))]
pub fn install(_faults: &[TestFault]) {}

/// Whether `fault` is planted in this process.
#[cfg(feature = "test-faults")]
pub fn on(fault: TestFault) -> bool {
    ACTIVE.get().is_some_and(|v| v.contains(&fault))
}

/// Without the feature no fault is ever planted.
#[cfg(not(feature = "test-faults"))]
#[inline(always)]
pub const fn on(_fault: TestFault) -> bool {
    false
}

/// Whether to pause after this batch ([`TestFault::PauseAfterSink`]): true once
/// per process, for its first batch with events.
pub fn pause_once() -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    static DONE: AtomicBool = AtomicBool::new(false);
    on(TestFault::PauseAfterSink) && !DONE.swap(true, Ordering::SeqCst)
}

/// Whether this build can plant faults at all (feature `test-faults`).
pub(crate) const ENABLED: bool = cfg!(feature = "test-faults");

/// Validates `test_faults:` of `name` into `errs`.
pub(crate) fn validate(names: &[String], name: &str, errs: &mut Vec<String>) -> Vec<TestFault> {
    let mut out = Vec::new();
    for (i, f) in names.iter().enumerate() {
        match TestFault::parse(f) {
            Some(t) => out.push(t),
            None if !ENABLED => errs.push(format!(
                "{name}: test_faults[{i}]: {f:?}: this build has no planted faults (only a test build, \
                 feature test-faults, has them)"
            )),
            None => errs.push(format!("{name}: test_faults[{i}]: {f:?} is not a known planted fault")),
        }
    }
    if !names.is_empty() && std::env::var(ENV).as_deref() != Ok("1") {
        errs.push(format!("{name}: test_faults: planted faults for the tests, refused unless {ENV}=1"));
    }
    out
}
